"""cascade's budget per verification step (budget="step", its paper mode): the per-node TVDs
of q_R to p along every root-to-leaf path sum to at most delta; budget="node" (the default)
holds delta per node only, and spends more along a path."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specimg import DraftTree, Scores
from specimg.methods import make_options
from specimg.plugins import PluginManager
from specimg.relax import tvd
from specimg.testing.conformance import step_engine
from specimg.testing.strategies import RelaxCase, relax_batches, relax_cases

LOOSE = {"tau_pos": -1.0, "tau_seq": -1.0}
"""Every node of the tree at the right depths donates: the budget, not the thresholds, binds."""


def path_sums(tree: DraftTree, dist: torch.Tensor, p: torch.Tensor) -> list[float]:
    """The TVD of q_R to p summed over each root-to-leaf path (each tree's, in a forest)."""
    per_node, parents = tvd(dist, p).tolist(), tree.parents.tolist()
    sums = []
    for leaf in (node for node, children in enumerate(tree.children) if not children):
        total, node = 0.0, leaf
        while node >= 0:
            total, node = total + per_node[node], parents[node]
        sums.append(total)
    return sums


@settings(max_examples=30, deadline=None)
@given(case=relax_cases(max_nodes=10, max_children=2), delta=st.sampled_from([0.05, 0.2, 0.5, 1.0]))
def test_every_path_keeps_within_delta(case: RelaxCase, delta: float):
    engine = step_engine("cascade", case, {"cascade": {**LOOSE, "budget": "step", "delta": delta}})
    dist = engine.relax(case.tree, case.scores)
    assert max(path_sums(case.tree, dist, case.p)) <= delta + 1e-5
    assert float(tvd(dist, case.p).max()) <= delta + 1e-5 and torch.allclose(dist.sum(-1), torch.ones(case.tree.size))


@settings(max_examples=15, deadline=None)
@given(batch=relax_batches(max_nodes=8, max_children=2))
def test_a_forest_keeps_each_path_within_delta(batch: list[RelaxCase]):
    forest = DraftTree.forest([case.tree for case in batch])
    scores = Scores(*(torch.cat([getattr(case.scores, part) for case in batch], dim=0 if part == "probs" else 1)
                      for part in ("probs", "hidden", "logits")))
    engine = step_engine("cascade", batch[0], {"cascade": {**LOOSE, "budget": "step", "delta": 0.3}})
    dist = engine.relax(forest, scores)
    assert max(path_sums(forest, dist, scores.probs)) <= 0.3 + 1e-5


def chain(nodes: int, vocab: int = 8) -> RelaxCase:
    """A chain whose states all agree: every node's neighbours in depth donate to it."""
    tree = DraftTree.from_parents(list(range(nodes)), [-1, *range(nodes - 1)])
    probs = torch.full((nodes, vocab), 1.0 / vocab)
    case = RelaxCase.of(tree, probs)
    return attrs.evolve(case, scores=case.scores._replace(hidden=torch.ones(1, nodes, 4)))


@pytest.mark.parametrize(("budget", "within"), [("step", True), ("node", False)])
def test_a_chain_spends_delta_once_per_step_or_once_per_node(budget: str, within: bool):
    """Power: per node, a 5-node chain moves 0.125 at each of its 4 inner nodes, 0.5 in all
    against delta 0.2 (each node within 0.2); per step, 0.2 along the whole chain."""
    case = chain(5)
    dist = step_engine("cascade", case, {"cascade": {**LOOSE, "budget": budget, "delta": 0.2}}).relax(case.tree, case.scores)
    total = path_sums(case.tree, dist, case.p)[0]
    assert (total <= 0.2 + 1e-6) == within and total > 0.19
    assert max(tvd(dist, case.p).tolist()) <= 0.2 + 1e-6


def test_the_paper_mode_is_a_step_budget_of_half():
    spec = PluginManager().methods()["cascade"]
    published = make_options(spec, spec.paper or {})
    assert (published.budget, published.delta) == ("step", 0.5) and spec.defaults.budget == "node"
