"""The launch counter (:mod:`specimg.testing.launches`) and the launches of a step on the
graph path, counted on the CPU: on a GPU each costs 10-20 us of the step, so a change that
adds tensor operations per tree level shows here, without a GPU."""

from __future__ import annotations

import torch

import specimg
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.stats import RunStats
from specimg.testing.launches import LaunchCounter, graph_path

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


def _graph_path_counts(method: str, tree: specimg.TreeConfig) -> tuple[dict[str, float], RunStats]:
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    counter = LaunchCounter()
    with graph_path(counter, target, drafter):
        engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=specimg.Sampling(cfg_scale=3.0), tree=tree)
        engine.generate([0], seed=9)
        with counter:
            stats = engine.generate([1], seed=0).stats
    steps = sum(len(image.accepted) for image in stats.images) or stats.tokens
    return {phase: count / steps for phase, count in counter.counts.items()}, stats


def test_an_ar_token_on_the_graph_path_is_its_replay_sampling_and_commit():
    """The replay and its one input's copy, the outputs' copies, sampling with CFG, the
    draw and the commit's length: about 13 (25 before the root got a step of its own)."""
    counts, stats = _graph_path_counts("ar", specimg.TreeConfig())
    assert stats.tokens == 16 and sum(counts.values()) <= 15, counts


def test_the_acceptance_walk_issues_a_fixed_handful_of_launches_per_level():
    """Sample-and-match on the device walks every level whatever it accepts: a draw, a
    lookup of the node's children and a match per level (about 9 launches), whatever the
    tree's width; a dozen more per step."""
    tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
    counts, _ = _graph_path_counts("naive", tree)
    assert counts["accept"] <= 10 * (tree.depth + 1) + 12, counts
