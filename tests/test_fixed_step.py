"""Fixed-shape step forwards (bucket padding, cache slots as tensors), compiled on CUDA.

The static mode is the compiled programs' arithmetic run as it is, so everything but the
compiler is checked here on the CPU (tests/test_compile.py compiles them); the CUDA tests
run where a GPU is."""

from __future__ import annotations


import pytest
import torch

import specimg
from specimg.compiled import BUCKETS, bucket
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
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_steps_decode_the_static_steps_images(batch: int) -> None:
    """On CUDA, programs compiled by inductor and captured as CUDA graphs (cudagraph trees)
    decode the images of the same fixed-shape steps run eagerly, for AR, an exact and a
    relaxed method (greedy: no draw may differ)."""
    target = build_target("GPT-B", seed=0, **TINY).cuda()
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8).cuda()
    greedy = specimg.Sampling(cfg_scale=3.0, temperature=0.0)
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12)
    for method in ("ar", "naive", "cascade+lantern"):
        runs = []
        for mode in ("static", "compiled"):
            target.set_step_mode(mode)
            drafter.set_step_mode(mode)
            engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=greedy, tokenizer=tokenizer, tree=tree,
                                    batch_size=batch)
            runs.append(engine.generate([1, 4, 7], seed=0).tokens)
        assert torch.equal(runs[1], runs[0]), method


@cuda
def test_compiled_ar_steps_never_wait_for_the_device() -> None:
    """AR on the compiled path waits for the device a few times an image (the condition's and
    the first token's transfers, the first draw, the image's one copy to the host), and
    never in a step: a 4x longer image waits no more often.  (On an H200: 5 and 4 times,
    the first count carrying a one-off; so each length is counted twice, the fewest kept.)"""
    engines = {}
    for block_size in (16, 64):
        target = build_target("GPT-B", seed=0, **{**TINY, "block_size": block_size}).cuda()
        engines[block_size] = specimg.Engine(target, method="ar", sampling=specimg.Sampling(cfg_scale=3.0), compile="on")
        engines[block_size].generate([1], seed=0)  # compiles
    syncs = {n: min(count_syncs(lambda: engine.generate([1], seed=0)) for _ in range(2)) for n, engine in engines.items()}
    assert syncs[64] <= syncs[16] <= 6, syncs


@cuda
def test_compiled_speculative_steps_wait_for_the_device_at_most_twice() -> None:
    """docs/architecture.md's count on the compiled path: naive waits once a step (the walk's
    outcome), cascade+lantern twice (with its checks' verdict), plus a few waits an image
    (as AR's, counted above)."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    for method, per_step in (("naive", 1), ("cascade+lantern", 2)):
        engine = specimg.Engine(target, drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tokenizer=tokenizer, compile="on",
                                tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12))
        steps = len(engine.generate([1], seed=0).stats.images[0].accepted)  # compiles; the same seed repeats its steps
        syncs = min(count_syncs(lambda: engine.generate([1], seed=0)) for _ in range(2))
        assert syncs <= per_step * steps + 6, (method, syncs, steps)


@cuda
def test_a_compiled_speculative_batch_waits_as_often_as_one_image() -> None:
    """Three images decoded together wait for the device no more often a step than one
    image does (their trees relaxed as one forest, walked in one program), plus a few waits
    an image."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64}).cuda()
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    for method, per_step in (("naive", 1), ("cascade+lantern", 2)):
        engine = specimg.Engine(target, drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tokenizer=tokenizer, compile="on",
                                tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=12), batch_size=3)
        images = engine.generate([1, 2, 3], seed=0).stats.images  # compiles; the same seeds repeat their steps
        steps = max(len(image.accepted) for image in images)
        syncs = min(count_syncs(lambda: engine.generate([1, 2, 3], seed=0)) for _ in range(2))
        assert syncs <= per_step * steps + 6 * len(images), (method, syncs, steps)
