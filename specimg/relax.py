"""Relaxation under a total-variation budget: the one shared mechanism, and the one place
the budget contract (docs/architecture.md) is enforced.

A method names, per node, its candidates (the node's children, in draft-rank order) and
for each candidate an ordered list of donor tokens.  ``transfer`` moves probability mass
from donors to candidates; since donors are never candidates, the TVD of the result to p
is exactly the mass moved, and the chance of accepting some child can only grow.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

_TOL = 1e-4


def tvd(a: Tensor, b: Tensor) -> Tensor:
    """Total-variation distance per row."""
    return 0.5 * (a.double() - b.double()).abs().sum(dim=-1)


def first_occurrence(tokens: Tensor) -> Tensor:
    """True where a token appears for the first time along the last dim (ignoring -1)."""
    ordered, order = tokens.sort(dim=-1, stable=True)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    return ~repeat.scatter(-1, order, repeat) & (tokens >= 0)


def transfer(
    dist: Tensor,
    target_dist: Tensor,
    candidates: Tensor,
    donors: Tensor,
    budget: Tensor,
    cap: Tensor | None = None,
    whole: bool = False,
    distinct: bool = False,
) -> tuple[Tensor, Tensor]:
    """Move mass from donors to candidates, for all nodes at once.

    dist, target_dist: [n, V] current and target distributions.  candidates: [n, C] tokens
    in priority order (-1 = none).  donors: [n, C, K] each candidate's donors in order (-1 =
    none; repeats, candidates and the candidate itself are skipped).  budget: [n] the mass a
    node may still move.  cap: [n, C] optional upper bound on a candidate's final mass.
    whole: move only whole donors (the longest prefix of donors that fits), as LANTERN does.
    distinct: each candidate's donor list holds no repeats (codebook neighbours, rank
    windows), which spares the search for them.  A candidate the target masks (p = 0)
    receives nothing.  Only nodes with candidates are touched.  Returns the new
    distribution and the mass moved per node.
    """
    n, width = candidates.shape
    moved = torch.zeros_like(budget, dtype=dist.dtype)
    rows = (candidates >= 0).any(dim=1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return dist, moved
    part, p = dist[rows], target_dist[rows]
    cands, donors, left = candidates[rows], donors[rows], budget[rows].to(dist.dtype).clone()
    at = torch.arange(rows.numel(), device=dist.device)
    is_candidate = torch.zeros_like(part, dtype=torch.bool)
    valid = cands >= 0
    is_candidate[at[:, None].expand_as(cands)[valid], cands[valid]] = True
    safe_donors = donors.clamp(min=0)
    donor_ok = (donors >= 0) & ~is_candidate.gather(1, safe_donors.flatten(1)).view_as(donors)
    if not distinct:
        donor_ok &= first_occurrence(donors)
    for j in range(width):
        cand = cands[:, j].clamp(min=0)
        receives = (cands[:, j] >= 0) & (p[at, cand] > 0)
        limit = torch.where(receives, left, torch.zeros_like(left))
        if cap is not None:
            limit = torch.minimum(limit, (cap[rows, j] - part[at, cand]).clamp(min=0))
        avail = part.gather(1, safe_donors[:, j]) * donor_ok[:, j]
        before = avail.cumsum(dim=1) - avail
        if whole:
            take = avail * (before + avail <= limit[:, None])
        else:
            take = torch.minimum(avail, (limit[:, None] - before).clamp(min=0))
        part.scatter_add_(1, safe_donors[:, j], -take)
        given = take.sum(dim=1)
        part[at, cand] += given
        left -= given
    out = dist.clone()
    out[rows] = part.clamp_(min=0)
    moved[rows] = budget[rows].to(dist.dtype) - left
    return out, moved


class BudgetError(RuntimeError):
    """A relaxation broke the contract: a bug in the method ``method``, which the message
    names, so that the CLI can name the package it came from."""

    def __init__(self, method: str, problem: str):
        super().__init__(f"method {method!r} {problem}")
        self.method = method


def check_relaxed(name: str, new: Tensor, before: Tensor, target_dist: Tensor, budget: Tensor, stack_delta: float) -> Tensor:
    """Enforce the contract on one method's output; return its TVD to the target per node.

    Runs every step, so it works in float32 with a tolerance for float32 rounding over V
    entries.
    """
    if new.shape != target_dist.shape:
        raise BudgetError(name, f"returned shape {tuple(new.shape)}, expected {tuple(target_dist.shape)}")
    if not bool(new.min() >= 0) or bool(((new.sum(-1) - 1).abs() > _TOL).any()):
        raise BudgetError(name, "returned something that is not a distribution")
    if bool(new.masked_fill(target_dist > 0, 0).any()):
        raise BudgetError(name, "put mass where the target's distribution is zero")
    if bool((0.5 * (new - before).abs().sum(-1) > budget + _TOL).any()):
        raise BudgetError(name, "spent more than its budget")
    distance = 0.5 * (new - target_dist).abs().sum(-1)
    if bool((distance > stack_delta + _TOL).any()):
        raise BudgetError(name, f"took the stack past its total-variation budget {stack_delta}")
    return distance


CHECKS_ENV = "SPECIMG_RELAX_CHECKS"


def checks_enabled() -> bool:
    """Whether fold checks every relaxation's contract: on unless ``$SPECIMG_RELAX_CHECKS``
    is 0.  Turn it off only to time a method without the checks' passes over [n, V]."""
    return os.environ.get(CHECKS_ENV, "1") != "0"


def fold(
    target_dist: Tensor,
    members: Sequence[tuple[str, float, Callable[..., Tensor | None]]],
    stack_delta: float,
    check: bool = True,
) -> Tensor:
    """Apply relaxations in stack order: each gets the previous result and the budget left
    (at most its own delta), and is checked before the next one runs (``check``; without
    it only the distance spent is measured, which the next member's budget needs)."""
    dist = target_dist
    spent = torch.zeros(target_dist.shape[0], dtype=target_dist.dtype, device=target_dist.device)
    for name, delta, relax in members:
        budget = (stack_delta - spent).clamp(min=0.0, max=delta)
        if not bool((budget > 0).any()):
            continue
        new = relax(dist=dist, budget=budget)
        if new is None:
            continue
        spent = check_relaxed(name, new, dist, target_dist, budget, stack_delta) if check else 0.5 * (new - target_dist).abs().sum(-1)
        dist = new
    return dist
