"""Relaxation under a total-variation budget: the one shared mechanism, and the one place
the budget contract (docs/architecture.md) is enforced.

A method names, per node, its candidates (the node's children, in draft-rank order) and
for each candidate an ordered list of donor tokens.  ``transfer`` moves probability mass
from donors to candidates; since donors are never candidates, the TVD of the result to p
is exactly the mass moved, and the chance of accepting some child can only grow.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor

from specimg import stalls

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
    receives nothing; a node without candidates moves nothing.  No host read off the CPU
    (``candidate_rows``; the loop is over the C candidate slots, not over nodes).  Returns
    the new distribution and the mass moved per node.
    """
    vocab = dist.shape[-1]
    rows = candidate_rows(candidates)
    part, p, left = dist[rows], target_dist[rows], budget[rows].to(dist.dtype)
    cands, donors = candidates[rows], donors[rows]
    valid = cands >= 0
    # which tokens are candidates of each node: a scatter, with no candidate sent to an extra column
    slots = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.int32, device=dist.device)
    slots.scatter_add_(1, torch.where(valid, cands, vocab), torch.ones_like(cands, dtype=torch.int32))
    is_candidate = slots[:, :vocab] > 0
    safe_donors = donors.clamp(min=0)
    donor_ok = (donors >= 0) & ~is_candidate.gather(1, safe_donors.flatten(1)).view_as(donors)
    if not distinct:
        donor_ok &= first_occurrence(donors)
    safe_cands = cands.clamp(min=0)
    receives = valid & (p.gather(1, safe_cands) > 0)  # what the loop reads of p, for every slot at once
    for j in range(cands.shape[1]):
        cand = safe_cands[:, j : j + 1]
        limit = left * receives[:, j]
        if cap is not None:
            limit = torch.minimum(limit, (cap[rows, j] - part.gather(1, cand)[:, 0]).clamp(min=0))
        avail = part.gather(1, safe_donors[:, j]) * donor_ok[:, j]
        before = avail.cumsum(dim=1) - avail
        if whole:
            take = avail * (before + avail <= limit[:, None])
        else:
            take = torch.minimum(avail, (limit[:, None] - before).clamp(min=0))
        part.scatter_add_(1, safe_donors[:, j], -take)
        given = take.sum(dim=1)
        part.scatter_add_(1, cand, given[:, None])
        left -= given
    out, moved = dist.clone(), torch.zeros_like(budget, dtype=dist.dtype)
    out[rows] = part.clamp_(min=0)
    moved[rows] = budget[rows].to(dist.dtype) - left
    return out, moved


def candidate_rows(candidates: Tensor) -> Tensor:
    """The nodes a relaxation must touch: on the CPU those with candidates (finding them is
    a host read, free there, and spares the leaves' work); elsewhere every node, since a
    host read would stall the device."""
    if stalls.host_reads_stall(candidates.device):
        return torch.arange(candidates.shape[0], device=candidates.device)
    return (candidates >= 0).any(dim=1).nonzero().squeeze(1)


def tree_by_tree(relaxers: Sequence[Callable[..., Tensor | None]], sizes: Sequence[int]) -> Callable[..., Tensor | None]:
    """A forest's relaxation by a method that relaxes one tree at a time: tree i's
    ``relaxers[i]`` gets its ``sizes[i]`` rows of the forest's distribution and budget (the
    trees lie one after another); None where every tree passes."""

    def relax(dist: Tensor, budget: Tensor) -> Tensor | None:
        rows = list(zip(dist.split(sizes), budget.split(sizes)))
        parts = [one(dist=mine, budget=spend) for one, (mine, spend) in zip(relaxers, rows)]
        if all(part is None for part in parts):
            return None
        return torch.cat([mine if part is None else part for part, (mine, _) in zip(parts, rows)])

    return relax


class BudgetError(RuntimeError):
    """A relaxation broke the contract: a bug in the method ``method``, which the message
    names, so that the CLI can name the package it came from."""

    def __init__(self, method: str, problem: str):
        super().__init__(f"method {method!r} {problem}")
        self.method = method


_BROKEN = (
    "returned something that is not a distribution",
    "put mass where the target's distribution is zero",
    "spent more than its budget",
    "took the stack past its total-variation budget {delta}",
)


def contract_breaches(
    new: Tensor, before: Tensor, target_dist: Tensor, budget: Tensor, stack_delta: float, budgeted: bool = True
) -> tuple[Tensor, Tensor]:
    """One method's output against the contract, on the device: which of ``_BROKEN`` it
    breaks [4] (bool), and its TVD to the target per node.  Works in float32 with a
    tolerance for float32 rounding over V entries.  A rule with no budget (a paper mode,
    not ``budgeted``) is held to its paper's law by its own tests: here only to being a
    distribution, since that law may leave p's support (a released rule's uniform residual)."""
    distance = 0.5 * (new - target_dist).abs().sum(-1)
    broken = (new.min() < 0) | ((new.sum(-1) - 1).abs() > _TOL).any()
    if not budgeted:
        return torch.stack([broken, *broken.new_zeros(3)]), distance
    breaches = torch.stack([
        broken,
        new.masked_fill(target_dist > 0, 0).any(),
        (0.5 * (new - before).abs().sum(-1) > budget + _TOL).any(),
        (distance > stack_delta + _TOL).any(),
    ])
    return breaches, distance


def raise_breach(names: Sequence[str], breaches: Tensor, stack_delta: float) -> None:
    """Raise a BudgetError for the first member whose row of ``breaches`` [members, 4] is
    set: a host read."""
    for name, row in zip(names, breaches.tolist()):
        if any(row):
            raise BudgetError(name, _BROKEN[row.index(True)].format(delta=stack_delta))


def checks_enabled() -> bool:
    """Whether fold checks every relaxation's contract: on unless ``$SPECIMG_RELAX_CHECKS``
    is 0.  Turn it off only to time a method without the checks' passes over [n, V]."""
    return os.environ.get("SPECIMG_RELAX_CHECKS", "1") != "0"


def fold(
    target_dist: Tensor,
    members: Sequence[tuple[str, float, Callable[..., Tensor | None]]],
    stack_delta: float,
    check: bool = True,
    unbudgeted: Collection[str] = (),
) -> Tensor:
    """Apply relaxations in stack order (:func:`fold_on_device`), then read the contract's
    verdicts: the step's one host read of them (a breach names the first member that broke it)."""
    dist, breaches = fold_on_device(target_dist, members, stack_delta, check, unbudgeted)
    if breaches is not None:
        raise_breach([name for name, _, _ in members], breaches, stack_delta)
    return dist


def fold_on_device(
    target_dist: Tensor,
    members: Sequence[tuple[str, float, Callable[..., Tensor | None]]],
    stack_delta: float,
    check: bool = True,
    unbudgeted: Collection[str] = (),
) -> tuple[Tensor, Tensor | None]:
    """Apply relaxations in stack order: each gets the previous result and the budget left
    (at most its own delta).  With ``check`` every output is held to the contract on the
    device, the verdicts one row per member [members, 4] (which of ``_BROKEN`` it breaks;
    none for a member that changed nothing) for the caller to read; without it (None) only
    the distance spent is measured, which the next member's budget needs.  Nothing here
    reads the host unless a member raises.  Members named in ``unbudgeted`` run a rule
    with no budget (``Member.budgeted``): their outputs are checked as distributions only.
    A member with no budget to spend (its delta
    or the stack's is 0) is skipped; one whose nodes have spent theirs runs and, by the
    contract, changes nothing."""
    dist = target_dist
    spent = torch.zeros(target_dist.shape[0], dtype=target_dist.dtype, device=target_dist.device)
    rows: list[Tensor | None] = []
    for name, delta, relax in members:
        rows.append(None)
        if delta <= 0 or stack_delta <= 0:
            continue
        budget = (stack_delta - spent).clamp(min=0.0, max=delta)
        try:
            new = relax(dist=dist, budget=budget)
        except Exception:
            if any(row is not None for row in rows):  # an earlier member's broken output may be what this one choked on
                raise_breach([name for name, _, _ in members], _verdicts(rows), stack_delta)
            raise
        if new is None:
            continue
        if new.shape != target_dist.shape:
            raise BudgetError(name, f"returned shape {tuple(new.shape)}, expected {tuple(target_dist.shape)}")
        if check:
            rows[-1], spent = contract_breaches(new, dist, target_dist, budget, stack_delta, name not in unbudgeted)
        else:
            spent = 0.5 * (new - target_dist).abs().sum(-1)
        dist = new
    return dist, _verdicts(rows) if check and any(row is not None for row in rows) else None


def _verdicts(rows: Sequence[Tensor | None]) -> Tensor:
    """Members' contract verdicts as one [members, 4] tensor (a member without one: none broken)."""
    made = next(row for row in rows if row is not None)
    return torch.stack([made.new_zeros(made.shape) if row is None else row for row in rows])
