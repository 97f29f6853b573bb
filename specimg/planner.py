"""Hardware-aware draft trees: choose each step's tree to maximise expected tokens per
second (the idea of Sequoia, Chen et al. 2024, applied to EAGLE-2 dynamic trees).

Two ingredients.  The *cost model* (:mod:`specimg.costmodel`) says what a tree of n nodes
costs to verify and a level of width k costs to draft on this machine.  The *acceptance
profile* (:mod:`specimg.profile`) says how likely the rank-r child of a reached node at
depth d is accepted; every step measures that chance for every child of every node it
walks, so the estimate settles in a few steps.

The planner values a tree (depth D, top-k K, N nodes) the way the EAGLE-2 builder grows
it, with the profile in place of the drafter's confidences: each level expands the K
likeliest frontier nodes into K children each, a node's value is the chance its whole
path is accepted, and the tree keeps the N - 1 most valuable nodes.  Expected tokens
per step = 1 + the kept values; seconds per step from the cost model; the choice
maximises their ratio.  It depends only on the cost model and the image's own
statistics, never on timings taken during the run, so a seed gives the same images.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch
from torch import Tensor

from specimg.config import TreeConfig
from specimg.costmodel import CostModel
from specimg.profile import MAX_DEPTH, MAX_TOPK, AcceptanceProfile

if TYPE_CHECKING:
    from specimg.tree import DraftTree

REPLAN_EVERY = 16


def tree_name(depth: int, topk: int, nodes: int) -> str:
    """An EAGLE-2 tree's shape in words; the one-node tree is AR, which the planner picks
    where it predicts that no tree pays."""
    return "AR (no tree predicted to pay)" if nodes == 1 else f"depth {depth}, top-k {topk}, {nodes} nodes"


@attrs.frozen
class Plan:
    """A chosen tree and what the cost model predicts for it; a one-node plan is AR (no
    tree pays: ``ar_plan``)."""

    depth: int
    topk: int
    nodes: int
    tokens_per_step: float
    step_ms: float
    speedup: float

    @property
    def is_ar(self) -> bool:
        return self.nodes == 1

    def tree(self, sample: bool = False) -> TreeConfig:
        """The plan's EAGLE-2 tree (AR's: the root alone)."""
        return TreeConfig(kind="dynamic", depth=max(1, self.depth), topk=max(1, self.topk), total_tokens=self.nodes, sample=sample)

    def __str__(self) -> str:
        return tree_name(self.depth, self.topk, self.nodes)


def ar_plan(cost: CostModel) -> Plan:
    """Plain AR steps: one token per target forward, at the cost model's AR step."""
    return Plan(0, 0, 1, 1.0, cost.ar_ms, 1.0)


def expected_tokens(rates: np.ndarray, depth: int, topk: int) -> np.ndarray:
    """E[tokens per step] for EAGLE-2 trees of depth ``depth`` and top-k ``topk`` with
    1, 2, ... nodes (entry i: i + 1 nodes), under acceptance ``rates`` [depth, rank]."""
    return next(tokens for d, tokens in _grown(rates, depth, topk) if d == depth)


def _grown(rates: np.ndarray, max_depth: int, topk: int):
    """For depth 1, 2, ...: (depth, E[tokens per step] by tree size) of the tree grown so far."""
    values, frontier = np.empty(0), np.ones(1)
    for depth in range(1, max_depth + 1):
        children = (frontier[:, None] * rates[min(depth, len(rates)) - 1, :topk]).ravel()
        values = np.concatenate([values, children])
        frontier = np.sort(children)[-topk:]
        yield depth, 1.0 + np.concatenate([[0.0], np.cumsum(np.sort(values)[::-1])])


def plans(cost: CostModel, rates: np.ndarray, max_nodes: int, max_fed: int = 128, method: str = "") -> Iterator[Plan]:
    """The best size of every (depth, top-k) tree that fits: at most ``max_nodes`` nodes,
    and at most ``max_fed`` drafter nodes fed ((depth - 1) * top-k); steps timed for
    ``method``'s stack (its step scale)."""
    scale = cost.scale(method)
    verify = cost.verify(np.arange(2, max_nodes + 1)) + cost.overhead_ms
    for topk in range(1, MAX_TOPK + 1):
        first = cost.draft(1, topk)
        level_ms = cost.draft(2, topk) - first
        for depth, tokens in _grown(rates, min(MAX_DEPTH, 1 + max_fed // topk), topk):
            tokens = tokens[1:max_nodes]  # trees of 2..max_nodes nodes
            ms = (verify[: tokens.size] + first + (depth - 1) * level_ms) * scale
            i = int(np.argmax(tokens / ms))
            yield Plan(depth, topk, i + 2, float(tokens[i]), float(ms[i]), float(tokens[i] / ms[i] * cost.ar_ms))


def choose(cost: CostModel, rates: np.ndarray, max_nodes: int, max_fed: int = 128, method: str = "") -> Plan:
    """The tree with the most expected tokens per second; ties go to the narrower, then
    the shallower tree."""
    candidates = plans(cost, rates, max_nodes, max_fed, method)
    best = next(candidates)
    for plan in candidates:
        if plan.speedup > best.speedup * (1 + 1e-9):
            best = plan
    return best


class TreePlanner:
    """One image's tree choice: plans from the prior, then re-plans every few steps from
    the image's own profile.  Every tree it switches to is kept with the step it started at.
    The prior is the method stack's acceptance measured when the cost model was calibrated
    (``cost.acceptance``), else a weak guess.

    With ``ar_fallback``, a plan from evidence (the image's own steps, or the measured
    prior) in which no tree is predicted faster than AR switches to AR (``ar_plan``) for
    the rest of the image: AR steps teach the profile nothing, and the profile pools the
    whole image, so more of the image would hardly move it.  The weak guess is no
    evidence: a first plan from it drafts."""

    def __init__(self, cost: CostModel, max_nodes: int, max_fed: int, device: torch.device | str, sample: bool = False, method: str = "",
                 ar_fallback: bool = True):
        self.cost, self.max_nodes, self.max_fed, self.sample, self.method = cost, max_nodes, max_fed, sample, method
        self.ar_fallback = ar_fallback
        measured = cost.acceptance.get(method)
        self.profile = AcceptanceProfile(device, prior=None if measured is None else np.array(measured))
        self.plans: list[tuple[int, Plan]] = []
        self._steps = 0
        self._replan()

    def _replan(self) -> None:
        plan = choose(self.cost, self.profile.rates(), self.max_nodes, max_fed=self.max_fed, method=self.method)
        if self.ar_fallback and (self._steps or self.profile.measured) and plan.speedup < 1.0:
            plan = ar_plan(self.cost)
        if not self.plans or plan.tree() != self.plans[-1][1].tree():
            self.plans.append((self._steps, plan))
        else:
            self.plans[-1] = (self.plans[-1][0], plan)  # same tree, newer prediction
        self.tree = plan.tree(self.sample)

    @property
    def plan(self) -> Plan:
        return self.plans[-1][1]

    def observe(self, tree: DraftTree, dist: Tensor, path: Sequence[int] | Tensor, greedy: bool) -> None:
        self.profile.observe(tree, dist, path, greedy)
        self._steps += 1
        if self._steps % REPLAN_EVERY == 0:
            self._replan()
