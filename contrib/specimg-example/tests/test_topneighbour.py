"""topneighbour against the specimg conformance kit, alone and stacked with built-ins,
plus its own rule on a hand-made step."""

from __future__ import annotations

import torch

from specimg import Engine, TreeConfig
from specimg.testing import statistics
from specimg.testing.conformance import make_conformance_tests
from specimg.tree import DraftTree
from specimg_example.topneighbour import TopNeighbourOptions, build_relaxed_dist

TestTopNeighbour = make_conformance_tests("topneighbour", "cascade+topneighbour", "topneighbour+gsd")


def test_most_probable_donors_first_and_capped():
    tree = DraftTree.from_parents([0, 3], [-1, 0])
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = build_relaxed_dist(p, p, torch.tensor([0.5, 0.5], dtype=torch.float64), tree, TopNeighbourOptions(k=2, max_ratio=2.0))
    assert torch.allclose(q[0], torch.tensor([0.3, 0.3, 0.2, 0.2]))  # token 3 doubles, from token 0 (the likeliest)
    assert torch.equal(q[1], p[1])  # a leaf has no candidates


def test_more_budget_accepts_more_drafts():
    problem = statistics.markov_problem(seed=0, num_tokens=8)
    tau = [
        Engine(problem.target, problem.drafter, "topneighbour", {"topneighbour": {"delta": delta}}, tree=TreeConfig(depth=3, topk=2, total_tokens=7))
        .generate([0] * 100, seed=0).stats.tau
        for delta in (0.0, 0.3)
    ]
    assert tau[1] > tau[0]
