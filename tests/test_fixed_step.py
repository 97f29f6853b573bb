"""Fixed-shape step forwards (bucket padding, cache slots as tensors) and their CUDA graphs.

The static mode is the graphs' arithmetic without the capture, so everything but the
capture is checked on the CPU; the CUDA tests run where a GPU is."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

import specimg
from specimg.errors import SpecimgError
from specimg.graphs import BUCKETS, bucket, step_mode
from specimg.lane import Lane
from specimg.models.base import causal_tree_mask
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.models.vq import build_tokenizer
from specimg.testing.syncs import count_syncs, counting_host_reads
from specimg.testing.trees import random_tree

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_buckets_hold_every_size_up_to_the_cache() -> None:
    assert [bucket(n, 128) for n in (1, 2, 3, 5, 12, 65, 128)] == [1, 2, 4, 8, 16, 128, 128]
    assert bucket(18, 20) == 20 and bucket(20, 20) == 20  # a cache for 20 nodes: its size is the last bucket
    assert bucket(150, 200) == 200
    assert all(bucket(n, 128) in BUCKETS and bucket(n, 128) >= n for n in range(1, 129))


def test_step_mode_follows_the_device() -> None:
    cpu = torch.device("cpu")
    assert step_mode("auto", cpu, supported=True) == "eager"
    assert step_mode("off", torch.device("cuda"), supported=True) == "eager"
    assert step_mode("auto", torch.device("cuda"), supported=True) == "graphs"
    assert step_mode("auto", torch.device("cuda"), supported=False) == "eager"
    with pytest.raises(SpecimgError, match="needs a CUDA target"):
        step_mode("on", cpu, supported=True)
    with pytest.raises(SpecimgError, match="cuda_graphs must be one of"):
        step_mode("yes", cpu, supported=True)  # type: ignore[arg-type]


def test_engine_refuses_graphs_off_a_gpu_and_off_turns_the_models_eager() -> None:
    target = build_target("GPT-B", seed=0, **TINY)
    with pytest.raises(SpecimgError, match="needs a CUDA target"):
        specimg.Engine(target, method="ar", cuda_graphs="on")
    target.set_step_mode("static")
    specimg.Engine(target, method="ar")  # auto off a GPU leaves the mode alone
    assert target.step_mode == "static"
    drafter = build_drafter(target, seed=1)
    drafter.set_step_mode("static")
    specimg.Engine(target, drafter, cuda_graphs="off")
    assert target.step_mode == drafter.step_mode == "eager"
    with pytest.raises(SpecimgError, match="CUDA graphs need"):
        target.set_step_mode("graphs")


@pytest.mark.parametrize("n", [1, 3, 8, 13])
def test_padding_near_the_end_of_the_cache_is_exact(n: int) -> None:
    """A cache for 20 tree nodes (not a bucket size) at the image's last tokens: the padded
    nodes fill the cache to its end and change no real node's output."""
    eager, fixed = (build_target("GPT-B", seed=0, **TINY, max_tree_nodes=20) for _ in range(2))
    fixed.set_step_mode("static")
    tokens, depths, mask, _ = random_tree(n, 64, seed=n)
    outs = []
    for target in (eager, fixed):
        target.prefill(2, cfg=True)
        for tok in range(15):  # all but the last image token committed
            target.forward_tree(torch.tensor([tok]), torch.tensor([0]), causal_tree_mask(1))
            target.commit(torch.tensor([0]))
        target.expose_layers([0, 1])
        outs.append(target.forward_tree(tokens, depths, mask))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_static_naive_reproduces_ar_and_eager_tokens() -> None:
    """Greedy naive equals greedy AR token for token in the static mode, and sampled AR in
    the static mode draws the eager mode's images (same seeds)."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    greedy = specimg.Sampling(cfg_scale=3.0, temperature=0.0)
    sampled = specimg.Sampling(cfg_scale=3.0, temperature=1.0)
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12)
    runs = {}
    for mode in ("eager", "static"):
        target.set_step_mode(mode)
        drafter.set_step_mode(mode)
        runs[mode] = (
            specimg.Engine(target, method="ar", sampling=greedy).generate([1, 4], seed=0).tokens,
            specimg.Engine(target, drafter, "naive", sampling=greedy, tree=tree).generate([1, 4], seed=0).tokens,
            specimg.Engine(target, method="ar", sampling=sampled).generate([1, 4], seed=0).tokens,
        )
    assert torch.equal(runs["static"][1], runs["static"][0])
    assert torch.equal(runs["static"][0], runs["eager"][0])
    assert torch.equal(runs["static"][2], runs["eager"][2])


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_fixed_shape_drafting_equals_eager_drafting(kind: str) -> None:
    """start and expand at fixed shapes (a drafter for 6 nodes: its last bucket is 6) give the
    eager logits over two steps, the second starting from three new pairs."""
    target = build_target("GPT-B", seed=0, **TINY)
    logits = {}
    for mode in ("eager", "static"):
        drafter = build_drafter(target, seed=1, kind=kind, max_tree_nodes=6)
        drafter.set_step_mode(mode)
        out = target.prefill(3, cfg=True)
        features = out.hidden if kind == "eagle1" else out.layers
        drafter.prefill(3, cfg=True)
        logits[mode] = [
            drafter.start(features, torch.tensor([5])),
            drafter.expand(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3])),  # 3 nodes: bucket 4
            drafter.expand(torch.tensor([1, 1, 3]), torch.tensor([4, 5, 6])),  # 3 more: the last bucket is 6 - 3
            drafter.start(features.expand(-1, 3, -1), torch.tensor([7, 8, 9])),
            drafter.expand(torch.tensor([0, 0]), torch.tensor([1, 2])),
            drafter.expand(torch.tensor([2]), torch.tensor([1])),
        ]
    for a, b in zip(logits["eager"], logits["static"]):
        assert b.shape == a.shape
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_ar_reads_the_device_twice_an_image(mode: str) -> None:
    """AR keeps each drawn token on the device for the next step: the host reads the first
    token (from the prefill) and the image's tokens once at the end, whatever its length."""
    for block_size in (16, 64):
        target = build_target("GPT-B", seed=0, **{**TINY, "block_size": block_size})
        target.set_step_mode(mode)
        engine = specimg.Engine(target, method="ar", sampling=specimg.Sampling(cfg_scale=3.0, top_k=10))
        with counting_host_reads() as reads:
            engine.generate([1], seed=0)
        assert sum(reads.values()) == 2, dict(reads)


def test_a_speculative_step_reads_the_device_at_most_tau_plus_four_times() -> None:
    """docs/architecture.md's bound on a step's host round trips, for naive on a dynamic tree."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=3.0),
                            tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10))
    with counting_host_reads() as reads:
        image = engine.generate([1], seed=0).stats.images[0]
    steps, tokens = len(image.accepted), sum(image.accepted) + len(image.accepted)  # tau = tokens / steps
    assert sum(reads.values()) <= tokens + 4 * steps + 2, (dict(reads), steps, tokens)


# ----------------------------------------------------------------------------- CUDA


@cuda
def test_graphs_replay_the_static_forward_exactly() -> None:
    """A replayed graph computes what the static forward computes, bucket by bucket, and
    its outputs are copies: the next replay does not change them."""
    outs = {}
    for mode in ("static", "graphs"):
        target = build_target("GPT-B", seed=0, **TINY).cuda()
        target.set_step_mode(mode)
        target.prefill(2, cfg=True)
        seen = []
        for n, seed in ((5, 0), (5, 1), (1, 2), (12, 3)):
            tokens, depths, mask, _ = random_tree(n, 64, seed=seed)
            seen.append(target.forward_tree(tokens.cuda(), depths.cuda(), mask.cuda()))
            target.commit(torch.tensor([0], device="cuda"))
        outs[mode] = seen
        if mode == "graphs":
            assert len(target.graphs) == 3  # buckets 8, 1 and 16
    for a, b in zip(outs["static"], outs["graphs"]):
        torch.testing.assert_close(b.logits, a.logits, atol=0, rtol=0)
        torch.testing.assert_close(b.hidden, a.hidden, atol=0, rtol=0)


@cuda
def test_graphed_naive_reproduces_graphed_ar() -> None:
    target = build_target("GPT-B", seed=0, **TINY).cuda()
    drafter = build_drafter(target, seed=1)
    greedy = specimg.Sampling(cfg_scale=3.0, temperature=0.0)
    ar = specimg.Engine(target, method="ar", sampling=greedy, cuda_graphs="on").generate([1, 4], seed=0).tokens
    naive = specimg.Engine(target, drafter, "naive", sampling=greedy, cuda_graphs="on",
                           tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12)).generate([1, 4], seed=0).tokens
    assert target.step_mode == "graphs" and len(target.graphs) > 0
    assert torch.equal(naive, ar)


@cuda
def test_a_graphed_relaxation_gives_the_eager_folds_tokens() -> None:
    """cascade+lantern's fold replayed as a CUDA graph per tree shape decodes the tokens of
    its eager fold, seed for seed."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    engine = specimg.Engine(target, drafter, "cascade+lantern", sampling=specimg.Sampling(cfg_scale=3.0), tokenizer=tokenizer,
                            cuda_graphs="on", tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
    replayed = engine.generate([1, 4], seed=0)
    assert len(engine.graphs) > 0
    with mock.patch.object(specimg.Engine, "_relax_replays", lambda self, tree: False):
        eager = engine.generate([1, 4], seed=0)
    assert torch.equal(replayed.tokens, eager.tokens)
    assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


@cuda
def test_a_forward_replayed_with_its_distributions_decodes_the_eager_distributions_tokens() -> None:
    """AR's step and the core's score of a tree, each replayed as one CUDA graph with the
    distributions made from its logits, decode what the forward's own graph followed by
    the eager distributions does, seed for seed."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    for method in ("ar", "naive"):
        engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), cuda_graphs="on",
                                tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
        replayed = engine.generate([1, 4], seed=0)
        assert any(key[0] == "program" for key in target.graphs._graphs)
        with mock.patch.object(specimg.Engine, "_target_replays", property(lambda self: False)), \
                mock.patch("specimg.engine.scores_replay", lambda target, sampling: False):
            eager = engine.generate([1, 4], seed=0)
        assert torch.equal(replayed.tokens, eager.tokens), method


@cuda
def test_a_walk_replayed_as_a_cuda_graph_decodes_the_eager_walks_tokens() -> None:
    """Sample-and-match's levels replayed as one CUDA graph per tree shape, each image's
    draws made before it from its own generator, decode what the eager device walk does,
    seed for seed: one image at a time and three together."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    for batch_size in (1, 3):
        engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=3.0), cuda_graphs="on", batch_size=batch_size,
                                tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
        replayed = engine.generate([1, 2, 3], seed=0)
        assert any(key[0] == "walk" for key in engine.graphs._graphs)
        with mock.patch.object(specimg.Engine, "_step_graphs", lambda self, tree: None):
            eager = engine.generate([1, 2, 3], seed=0)
        assert torch.equal(replayed.tokens, eager.tokens), batch_size
        assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


@cuda
def test_a_tree_grown_in_one_replayed_graph_gives_the_eager_growths_tokens() -> None:
    """The core's top-k tree growth replayed as one CUDA graph (its forwards' kernels
    recorded in it) decodes what growing it step by step does, seed for seed."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=3.0), cuda_graphs="on",
                            tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
    replayed = engine.generate([1, 4], seed=0)
    assert any(key[0] == "program" for key in drafter.graphs._graphs)
    with mock.patch.object(Lane, "_replayed_growth", lambda self, config: None):
        eager = engine.generate([1, 4], seed=0)
    assert torch.equal(replayed.tokens, eager.tokens)
    assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


@cuda
def test_a_batch_forest_grown_in_one_replayed_graph_is_the_eager_growths() -> None:
    """Three images' trees grown as one replayed CUDA graph (every level's drafter call for
    all of them) are, step by step, the trees the eager batch growth makes; so are the
    tokens."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=3.0), cuda_graphs="on", batch_size=3,
                            tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
    grown: dict[str, list[torch.Tensor]] = {"replayed": [], "eager": []}
    for growth, trees in grown.items():
        engine.on_step = lambda tree, dist, path, trees=trees: trees.append(torch.stack([tree.tokens, tree.parents]))
        with contextlib.nullcontext() if growth == "replayed" else mock.patch.object(specimg.Engine, "_grows_fixed", lambda *args: False):
            trees.append(engine.generate([1, 2, 3], seed=0).tokens)
    assert len(grown["replayed"]) == len(grown["eager"])
    assert all(torch.equal(a, b) for a, b in zip(grown["replayed"], grown["eager"]))


@cuda
def test_a_graphed_batch_decodes_its_static_steps_images_while_capturing_and_replaying() -> None:
    """A batch on the graph path (its verify with the distributions, its AR step, its commit
    and its growth each a CUDA graph, the commit captured without warm-up runs) decodes the
    images of the same fixed-shape steps run directly, on its first run, which captures,
    and on its second, which replays."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    for method in ("ar", "naive", "cascade+lantern"):
        engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tokenizer=tokenizer,
                                cuda_graphs="on", batch_size=3, tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
        target.graphs.clear()
        graphed = [engine.generate([1, 2, 3, 4], seed=0).tokens for _ in range(2)]  # captures, then replays
        assert any(key[0] == "commit" for key in target.graphs._graphs), method
        for model in (target, drafter):
            model.step_mode = "static"
        static = engine.generate([1, 2, 3, 4], seed=0).tokens
        for model in (target, drafter):
            model.step_mode = "graphs"
        assert all(torch.equal(tokens, static) for tokens in graphed), method


@cuda
def test_graphed_ar_steps_never_wait_for_the_device() -> None:
    """AR on the graph path waits for the device a few times an image (the condition's and
    the first token's transfers, the first draw, the image's one copy to the host), and
    never in a step: a 4x longer image waits no more often.  (On an H200: 5 and 4 times,
    the first count carrying a one-off; so each length is counted twice, the fewest kept.)"""
    engines = {}
    for block_size in (16, 64):
        target = build_target("GPT-B", seed=0, **{**TINY, "block_size": block_size}).cuda()
        engines[block_size] = specimg.Engine(target, method="ar", sampling=specimg.Sampling(cfg_scale=3.0), cuda_graphs="on")
        engines[block_size].generate([1], seed=0)  # captures
    syncs = {n: min(count_syncs(lambda: engine.generate([1], seed=0)) for _ in range(2)) for n, engine in engines.items()}
    assert syncs[64] <= syncs[16] <= 6, syncs


@cuda
def test_graphed_speculative_steps_wait_for_the_device_at_most_twice() -> None:
    """docs/architecture.md's count on the graph path: naive waits once a step (the walk's
    outcome), cascade+lantern twice (with its checks' verdict), plus a few waits an image
    (as AR's, counted above)."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    for method, per_step in (("naive", 1), ("cascade+lantern", 2)):
        engine = specimg.Engine(target, drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tokenizer=tokenizer, cuda_graphs="on",
                                tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
        steps = len(engine.generate([1], seed=0).stats.images[0].accepted)  # captures; the same seed repeats its steps
        syncs = min(count_syncs(lambda: engine.generate([1], seed=0)) for _ in range(2))
        assert syncs <= per_step * steps + 6, (method, syncs, steps)


@cuda
def test_a_graphed_speculative_batch_waits_as_often_as_one_image() -> None:
    """Three images decoded together wait for the device no more often a step than one
    image does (their trees relaxed as one forest, walked in one program), plus a few waits
    an image."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    for method, per_step in (("naive", 1), ("cascade+lantern", 2)):
        engine = specimg.Engine(target, drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tokenizer=tokenizer, cuda_graphs="on",
                                tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12), batch_size=3)
        images = engine.generate([1, 2, 3], seed=0).stats.images  # captures; the same seeds repeat their steps
        steps = max(len(image.accepted) for image in images)
        syncs = min(count_syncs(lambda: engine.generate([1, 2, 3], seed=0)) for _ in range(2))
        assert syncs <= per_step * steps + 6 * len(images), (method, syncs, steps)
