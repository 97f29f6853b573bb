"""The launch counter (:mod:`specimg.testing.launches`) and the launches of a step on the
graph path, counted on the CPU: on a GPU each costs 10-20 us of the step, so a change that
adds tensor operations per tree level shows here, without a GPU."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import specimg
from specimg import costs
from specimg.engine import Engine
from specimg.models.eagle import DraftBatch, build_drafter
from specimg.models.llamagen import build_target
from specimg.models.text_encoder import HashTextEncoder, captions_for_target
from specimg.models.vq import build_tokenizer
from specimg.graphs import GraphSet
from specimg.lane import Lane
from specimg.sampling import draw
from specimg.testing.launches import LaunchCounter, NotCapturable, emulated_captures, graph_path

TREE_COLUMNS = ("tokens", "parents", "depths", "mask", "logprobs", "child_ids")
"""The tensors of a top-k tree (no draft distributions): what a replayed growth makes."""

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)


def launches(run) -> int:
    counter = LaunchCounter()
    with counter:
        run()
    return sum(counter.counts.values())


def test_views_and_no_op_conversions_launch_nothing_and_kernels_launch_once():
    x = torch.randn(4, 3)
    assert launches(lambda: (x.view(-1), x.flatten(), x.t(), x.to(torch.float32), x[1:], torch.empty(3))) == 0
    assert launches(lambda: x + 1) == 1
    assert launches(lambda: x.add_(1)) == 1
    assert launches(lambda: x.t().flatten()) == 1  # a copy: not contiguous
    assert launches(lambda: x.to(torch.float64)) == 1


def test_a_multinomial_draw_counts_the_kernels_it_runs_below_the_dispatcher():
    """``torch.multinomial`` checks the distribution, then draws, in kernels the counter
    cannot see one by one: counted as their number.  The engine's own draw is the draw alone."""
    probs = torch.full((8,), 1 / 8)
    assert launches(lambda: torch.multinomial(probs, 1)) == 12
    assert launches(lambda: draw(probs, None)) == 3


@pytest.mark.parametrize("read", [
    lambda x: x.sum().item(), lambda x: bool(x.any()), lambda x: x.tolist(), lambda x: x.nonzero(),
    lambda x: torch.bincount(x.long()), lambda x: x + torch.tensor([1.0, 2.0]),
], ids=["item", "bool", "tolist", "nonzero", "bincount", "host-data"])
def test_an_emulated_capture_refuses_what_no_cuda_graph_can_replay(read):
    counter = LaunchCounter()
    with emulated_captures(counter), counter, pytest.raises(NotCapturable):
        GraphSet().run("step", lambda x: [read(x)], [torch.ones(2)])
    with emulated_captures(counter), counter:  # the warm-up runs outside the capture: anything goes there
        GraphSet().run("step", lambda x: [x * 2], [torch.ones(2)])


def test_a_replay_copies_in_only_the_inputs_its_function_reads():
    """A graph's first warm-up run finds which inputs its function reads (an operation
    takes them, or they come back as outputs); a replay copies in those alone, and its
    results are the function's on the new inputs."""
    counter = LaunchCounter()
    graphs = GraphSet()

    def fn(x: torch.Tensor, ignored: torch.Tensor, handed_back: torch.Tensor) -> list[torch.Tensor]:
        return [x * ignored.shape[0], handed_back]

    first, then = [torch.ones(3), torch.zeros(2), torch.zeros(1)], [torch.full((3,), 2.0), torch.full((2,), 7.0), torch.full((1,), 5.0)]
    with emulated_captures(counter):
        graphs.run("step", fn, first)
        counter.counts.clear()  # the capture's own run
        with counter:
            out = graphs.run("step", fn, then)
    assert sum(counter.counts.values()) == 3  # two copies and the replay
    assert out[0].tolist() == [4.0, 4.0, 4.0] and out[1].tolist() == [5.0]


def _graph_path_counts(method: str, tree: specimg.TreeConfig, images: int = 1, trees: list | None = None,
                       kind: str = "eagle1") -> tuple[dict[str, float], specimg.Generation, Engine]:
    """Launches per step by phase on the graph path (``images`` decoded as one batch; a
    ``kind`` drafter), and what the counted run generated (each step's tree columns and
    height into ``trees``); every replayed program must have run no call a graph cannot
    replay (the counter raises on one)."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1, kind=kind)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    counter = LaunchCounter()
    with graph_path(counter, target, drafter):
        engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tree=tree,
                                tokenizer=tokenizer, batch_size=images)
        if trees is not None:
            engine.on_step = lambda tree, dist, path: trees.append(([getattr(tree, c).clone() for c in TREE_COLUMNS], tree.height))
        with counter:
            engine.generate(list(range(images)), seed=9)  # the captures, checked
        counter.counts.clear()
        with counter:
            result = engine.generate(list(range(1, images + 1)), seed=0)
    stats = result.stats
    steps = max(len(image.accepted) for image in stats.images) or stats.tokens
    return {phase: count / steps for phase, count in counter.counts.items()}, result, engine


def test_an_ar_token_on_the_graph_path_is_one_replay_its_draw_and_commit():
    """The forward and the token's distribution (guidance, filter, softmax) replay as one
    graph: its one input's copy, the replay, the draw (variates, division, argmax) and the
    commit's length, 6 a token, with the image's prefill and first draw spread over its 16
    tokens at most 9 (14.5 when the distribution was made eagerly); the same tokens as then."""
    counts, result, _ = _graph_path_counts("ar", specimg.TreeConfig())
    with mock.patch.object(Engine, "_target_replays", property(lambda self: False)):
        eager_counts, eager, _ = _graph_path_counts("ar", specimg.TreeConfig())
    assert result.stats.tokens == 16 and sum(counts.values()) <= 9 < 14 < sum(eager_counts.values()), (counts, eager_counts)
    assert torch.equal(result.tokens, eager.tokens)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_tree_is_scored_in_one_replay_with_its_distributions(kind):
    """The core's score of a tree, the target's forward and the distributions made from its
    logits, replays as one graph per tree size: the tree's three columns copied in, the
    replay, the scores copied out (with an EAGLE-3 drafter, the exposed layers' states
    too), where the distributions alone cost 7 launches eagerly; the same tokens."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    counts, replayed, engine = _graph_path_counts("naive", tree, kind=kind)
    with mock.patch("specimg.engine.scores_replay", lambda target, sampling: False):
        eager_counts, eager, _ = _graph_path_counts("naive", tree, kind=kind)
    assert counts["verify"] <= 8 < eager_counts["verify"], (counts, eager_counts)
    assert any(key[1][0] == "score" for key in engine.target.graphs._graphs if key[0] == "program")
    assert torch.equal(replayed.tokens, eager.tokens)
    assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_batch_of_trees_is_scored_in_one_replay_with_its_distributions(kind):
    """A batch's verify, the target's forward over every image's tree, the picking of
    their nodes and the distributions, replays as one graph per tree size and node count:
    the trees' columns and the nodes' ids copied in, the replay, the scores copied out
    (some 20 launches eagerly); the same tokens."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    counts, replayed, engine = _graph_path_counts("naive", tree, images=3, kind=kind)
    with mock.patch("specimg.engine.batch_scores_replay", lambda target, sampling: False):
        eager_counts, eager, _ = _graph_path_counts("naive", tree, images=3, kind=kind)
    assert counts["verify"] <= 12 < 18 < eager_counts["verify"], (counts, eager_counts)
    assert any(key[0] == "batch program" and key[1][0] == "scores" for key in engine.target.graphs._graphs)
    assert torch.equal(replayed.tokens, eager.tokens)
    assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


@pytest.mark.parametrize("kind", ["c2i", "t2i"])
@pytest.mark.parametrize("method", ["ar", "cascade+lantern"])
@pytest.mark.parametrize("images", [1, 3])
def test_the_images_decoded_while_the_graphs_are_captured_are_the_static_steps(images, method, kind):
    """The first decode on the graph path captures every program it replays, each run as
    a capture runs it (warm-up runs, then the capture); a program that moves state for
    good (a batch's commit) must still move it once.  Its images, class-conditioned or
    from captions, are those of the same steps at fixed shapes without graphs."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    target = build_target("GPT-B", seed=0, **(dict(TINY, model_type="t2i", cls_token_num=5, caption_dim=12) if kind == "t2i" else TINY))
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, codebook_size=TINY["vocab_size"], codebook_embed_dim=8)
    texts = ["a cat", "a long red bus at dawn", "sea"][:images]
    conditions = captions_for_target(HashTextEncoder(dim=12), texts, 5, 12) if kind == "t2i" else list(range(images))

    def generate() -> torch.Tensor:
        engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tree=tree, tokenizer=tokenizer,
                                batch_size=images, cuda_graphs="auto")
        return engine.generate(conditions, seed=5).tokens

    with graph_path(LaunchCounter(), target, drafter):
        captured = generate()
        for model in (target, drafter):
            model.step_mode = "static"
        static = generate()
    assert torch.equal(captured, static)


@pytest.mark.parametrize("method", ["naive", "gsd"])
@pytest.mark.parametrize("images", [1, 3])
def test_the_acceptance_walk_replays_as_one_graph_after_its_draws(images, method):
    """Sample-and-match on the device replays its levels as one graph per tree shape: per
    step, each image's Exp(1) variates for every level, drawn outside the graph from its
    own generator, and a handful of launches (the inputs' copies, the replay, the
    outcome's copy), where each level cost some 6 launches eagerly.  So does it where a
    member's ``accept`` passes (GSD's budgeted mode), for a batch on every tree at once,
    measuring the budget each path spent in the same program.  The tokens are the eager
    walk's."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    counts, replayed, engine = _graph_path_counts(method, tree, images=images)
    with mock.patch.object(Engine, "_step_graphs", lambda self, tree: None):
        eager_counts, eager, _ = _graph_path_counts(method, tree, images=images)
    handful = 8 if method == "naive" else 10  # a relaxed stack's walk also takes p and hands back the budget its paths spent
    assert counts["accept"] <= images * (tree.depth + 1) + handful < eager_counts["accept"], (counts, eager_counts)
    assert any(key[0] == "walk" for key in engine.graphs._graphs)
    assert torch.equal(replayed.tokens, eager.tokens)
    assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


def test_a_capturable_stack_relaxes_in_one_replay_and_its_copies_with_the_same_tokens():
    """cascade+lantern's fold (some 280 launches a step eagerly, its checks included)
    replays as one graph: the replay, the copies of the inputs it reads (the tree's
    tokens, parents, depths and children, the distributions and the states: not the
    mask, the draft log-probs or the logits) and q_R's copy out, 8.  The tokens and
    accepted lengths are the eager fold's."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    counts, replayed, _ = _graph_path_counts("cascade+lantern", tree)
    with mock.patch.object(Engine, "_relax_replays", lambda self, tree: False):
        eager_counts, eager, _ = _graph_path_counts("cascade+lantern", tree)
    assert counts["relax"] <= 8 < eager_counts["relax"], (counts, eager_counts)
    assert torch.equal(replayed.tokens, eager.tokens)
    assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


def test_a_batch_relaxes_its_forest_in_one_replay_with_the_same_tokens():
    """At batch size 3 the forest's fold replays as a graph too (the forest's per-tree
    offsets are found on the device, not copied from the host), with the eager fold's
    tokens and over a hundred launches a step fewer."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    counts, replayed, engine = _graph_path_counts("cascade+lantern", tree, images=3)
    with mock.patch.object(Engine, "_relax_replays", lambda self, tree: False):
        eager_counts, eager, eager_engine = _graph_path_counts("cascade+lantern", tree, images=3)
    relaxed = [[key for key in e.graphs._graphs if key[0] == "relax"] for e in (engine, eager_engine)]
    assert relaxed[0] and not relaxed[1]
    assert sum(counts.values()) + 100 < sum(eager_counts.values()), (counts, eager_counts)
    assert torch.equal(replayed.tokens, eager.tokens)
    assert [image.accepted for image in replayed.stats.images] == [image.accepted for image in eager.stats.images]


def test_a_tree_grows_in_one_replay_as_it_grows_eagerly():
    """The core's top-k tree grows as one replayed graph (the drafter's start apart):
    some 18 launches a step instead of some 115 on this tree, every step's tree the eager
    growth's, column for column, and so the same tokens."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    replayed_trees, eager_trees = [], []
    counts, replayed, _ = _graph_path_counts("naive", tree, trees=replayed_trees)
    with mock.patch.object(Lane, "_replayed_growth", lambda self, config: None):
        eager_counts, eager, _ = _graph_path_counts("naive", tree, trees=eager_trees)
    assert counts["draft"] <= 20 and eager_counts["draft"] > 60, (counts, eager_counts)
    assert len(replayed_trees) == len(eager_trees) > 0
    for (columns, height), (want, want_height) in zip(replayed_trees, eager_trees):
        assert height == want_height and all(torch.equal(a, b) for a, b in zip(columns, want))
    assert torch.equal(replayed.tokens, eager.tokens)


def test_a_batch_grows_its_forest_in_one_replay_as_it_grows_eagerly():
    """At batch size 3 the batch's forest grows as one replayed graph per tree shape:
    every level's drafter call for all the places, their top-k and the forest's assembly
    (a place whose image finished, or drafts a shallower tree near its end, grows a
    scratch tree, so every step replays).  Each image's tree at each step is the one the
    eager growth makes, and so are the tokens."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    replayed_trees, eager_trees = [], []
    with mock.patch.object(DraftBatch, "expand", side_effect=AssertionError("a batch step grew eagerly")):
        counts, replayed, engine = _graph_path_counts("naive", tree, images=3, trees=replayed_trees)
    with mock.patch.object(Engine, "_grows_fixed", lambda *args: False):
        eager_counts, eager, _ = _graph_path_counts("naive", tree, images=3, trees=eager_trees)
    assert counts["draft"] + 100 < eager_counts["draft"], (counts, eager_counts)
    assert len(replayed_trees) == len(eager_trees) > 0
    for (columns, height), (want, want_height) in zip(replayed_trees, eager_trees):
        tokens, parents, depths, mask, logprobs, child_ids = columns
        assert height == want_height
        assert all(torch.equal(a, b) for a, b in zip((tokens, parents, depths, mask, child_ids), (*want[:4], want[5])))
        torch.testing.assert_close(logprobs, want[4])  # the drafter attends over its whole cache: rounding may differ
    assert torch.equal(replayed.tokens, eager.tokens)


def test_a_batch_keeps_its_graphs_in_the_drafters_set_from_run_to_run():
    """A batch's graphs (its start, its forests' growth) live in the drafter's graph set,
    keyed apart from one image's, so their capture time is counted with the drafter's
    (calibration leaves it out); the drafter keeps the batch, so a run repeating the
    first's steps captures nothing new."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    with graph_path(LaunchCounter(), target, drafter):
        engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=3.0), tree=tree, batch_size=3)
        engine.generate([1, 2, 3], seed=0)
        kinds = {key[0] for key in drafter.graphs._graphs}
        captured = len(drafter.graphs)
        engine.generate([1, 2, 3], seed=0)
    assert kinds == {"batch"} and len(drafter.graphs) == captured
    assert drafter.batch(3, cfg=True) is drafter.batch(3, cfg=True)


def test_trees_of_sampled_drafts_relax_walk_and_grow_eagerly():
    """A sampled tree's size changes from step to step (and its growth draws): no graph
    per size, for the fold, the walk or the growth (the image's last step, the root
    alone, is no sampled tree); the same tokens as with the replays off."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10, sample=True)
    _, sampled, engine = _graph_path_counts("cascade+lantern", tree)
    keys = list(engine.graphs._graphs)
    relax_heights = [key[4] for key in keys if key[0] == "relax"]
    walk_depths = [key[2] for key in keys if key[0] == "walk"]
    assert relax_heights in ([], [0]) and walk_depths in ([], [1]), keys  # the root alone: height 0, one level
    assert not any(key[0] == "program" for key in engine.drafter.graphs._graphs)
    with mock.patch.object(Engine, "_step_graphs", lambda self, tree: None), mock.patch.object(Lane, "_replayed_growth", lambda self, config: None):
        _, eager, _ = _graph_path_counts("cascade+lantern", tree)
    assert torch.equal(sampled.tokens, eager.tokens)


def test_the_cost_model_times_the_programs_the_graph_path_replays():
    """On the graph path the cost model times what the engine runs: AR's step and each
    verify with their distributions as one replayed program, each tree's growth as one,
    the walk replayed; every timing comes out positive, and no program calls what a
    graph cannot replay."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64})
    drafter = build_drafter(target, seed=1)
    counter = LaunchCounter()
    with graph_path(counter, target, drafter), counter, mock.patch.object(costs, "_REPEATS", 2), \
            mock.patch.object(costs, "walk_forest", wraps=costs.walk_forest) as walk:
        model = costs.measure(target, drafter, specimg.Sampling(cfg_scale=3.0), 1)
    programs = {key[1][0] for key in target.graphs._graphs if key[0] == "program"}
    grown = {key[1][1] for key in drafter.graphs._graphs if key[0] == "program" and key[1][0] == "grow"}
    assert programs == {"score", "ar"} and {depth for depth, *_ in grown} == {1, 3}, (programs, grown)
    assert walk.call_args_list and all(isinstance(call.args[4], GraphSet) for call in walk.call_args_list)
    assert model.ar_ms > 0 and all(ms > 0 for _, ms in (*model.verify_ms, *model.draft_base_ms, *model.draft_level_ms)) and model.overhead_ms > 0


def test_the_cost_model_of_a_batch_times_its_verify_replayed():
    """At a batch size above 1 the cost model times the batch's verify and AR step as the
    engine runs them on the graph path: the forward over every image's tree (one node
    each for AR) and the distributions as one replayed program per tree size."""
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64})
    drafter = build_drafter(target, seed=1)
    counter = LaunchCounter()
    with graph_path(counter, target, drafter), counter, mock.patch.object(costs, "_REPEATS", 2):
        model = costs.measure(target, drafter, specimg.Sampling(cfg_scale=3.0), 1, batch=3)
    programs = [key[1] for key in target.graphs._graphs if key[0] == "batch program"]
    scored = {key[1][1] for key in programs if key[0] == "scores"}
    assert scored == {n for n, _ in model.verify_ms} and ("ar", True) in programs, (programs, model.verify_ms)
    assert model.ar_ms > 0 and all(ms > 0 for _, ms in model.verify_ms)
