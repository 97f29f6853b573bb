"""coolsd: COOL-SD, annealed relaxation of speculative decoding (Li, Zhang, Du, Ji; AAAI
2026, arXiv 2601.09212).

The paper's method section could not be read when this plugin was written (only its
abstract), so its equations, their numbers and its default settings are NOT checked here.
The rule below is derived from the two results the abstract states, and every name in it
(R1, R2, eq. C1-C4) is this module's, not the paper's:

R1. Relaxed speculative sampling at one draft position: draft x ~ q, accept x with
    probability a(x), else emit a draw of a resampling distribution r.  Its output law is
    q*a + beta*r (beta = 1 - sum q*a), and for every r

        TV(q*a + beta*r, p)  >=  sum_y (q(y) a(y) - p(y))^+                       (C1)

    with equality for r* = norm(max(0, p - q*a)), the optimal residual: the bound's
    minimiser.  With r* the acceptance rate is 1 - TV(p, q) + TV(output, p): each unit of
    TVD spent buys one unit of acceptance, the most any rule can (a maximal coupling).
R2. Relaxing early draft positions buys more accepted length per unit of TVD (position l
    is reached only if 1..l-1 were accepted), so the budget is annealed along the draft:

        delta_l = delta * decay^(l - 1),   l = 1 for a root's children               (C2)

    (decay = 1 is the uniform relaxation R2 compares against.)

``acceptance="reject"``, on a chain of sampled drafts x_l ~ q_l (a drafter's sampled
chain, or sjd's windows: sjd+coolsd), spends delta_l by drawing the relaxed target toward
the draft, which reaches the C1 bound exactly:

    q a_l  = min(q, p) + w_l * max(0, q - p),   w_l = min(1, delta_l / TV(p, q))      (C3)
    accept x_l with probability a_l(x_l); at the first rejection emit y ~ r*_l and stop
    (the whole chain accepted: emit y ~ p at its last node)

so TV(output_l, p) = min(delta_l, TV(p, q)) at every position, on average over the draft.
A donor relaxation's q_R depends on the drawn child, and r* needs every token's a, so this
rule does not stack with lantern, lantern++, cascade or gsd: its target is its own.

``acceptance="match"`` (the default) is the same idea for any tree, on the core's
sample-and-match.  A top-k draft is a point mass, and C1's r* is then p itself off the
candidates, so at node u (depth d) the annealed budget moves onto u's candidates, in
proportion to their mass, from every non-candidate in proportion to its mass:

    m_u    = min(budget_u, delta * decay^d, mass of the non-candidates)
    q_R(c) = dist(c) * (1 + m_u / dist(candidates)),   q_R(y) = dist(y) * (1 - m_u / dist(others))   (C4)

It keeps the budget contract and stacks with every relaxation (their donors first, then C4).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from attrs import validators as v
from torch import Tensor

from specimg import Acceptance, DraftTree, MethodSpec, Sampling, Scores, SpecimgError, chain_acceptance, hookimpl
from specimg.relax import tvd

ACCEPTANCES = ("match", "reject")


@attrs.frozen
class CoolSDOptions:
    """delta: TVD budget at the first draft position; decay: the annealing factor per
    position along the draft (C2; 1 = uniform); acceptance: "match" (C4 on any tree, the
    core's sample-and-match) or "reject" (C3 with the optimal residual, sampled chains)."""

    delta: float = attrs.field(default=0.3, validator=[v.ge(0.0), v.le(1.0)])
    decay: float = attrs.field(default=0.7, validator=[v.gt(0.0), v.le(1.0)])
    acceptance: str = attrs.field(default="match", validator=v.in_(ACCEPTANCES))

    @property
    def budgeted(self) -> bool:
        """Whether q_R keeps the per-node budget contract; "reject" keeps delta_l on average
        over the draft instead (C3), which its own tests check exactly."""
        return self.acceptance == "match"


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "coolsd", CoolSDOptions, "COOL-SD: a budget annealed along the draft, resampled from the TV-optimal residual",
        stacked_defaults={"sjd": {"acceptance": "reject"}},  # sjd's sampled chains: the rejection rule
        paper={"acceptance": "reject"},
        departures=(
            "the paper's text could not be read: its equation numbers and default settings are unchecked; the rule is derived "
            "from its abstract's two results (plugins/coolsd.py: C1 the TV bound and its optimal residual, C2 the annealing, "
            "C3 its rejection rule on sampled chains); the default acceptance=match (C4) carries both to any tree within the "
            "per-node budget"
        ),
        batch=True,
    ))


def annealed(delta: float, decay: float, depths: Tensor) -> Tensor:
    """C2: the budget of a node at each depth, for the draft position of its children."""
    return delta * decay ** depths.double()


@hookimpl
def build_relaxed_dist(dist: Tensor, budget: Tensor, tree: DraftTree, options: CoolSDOptions) -> Tensor | None:
    if options.acceptance != "match":  # the rejection rule relaxes in its acceptance, not on q_R
        return None
    candidates = tree.candidates()[0].to(dist.device)
    vocab = dist.shape[-1]
    marks = torch.zeros(dist.shape[0], vocab + 1, dtype=torch.bool, device=dist.device)
    marks.scatter_(1, torch.where(candidates >= 0, candidates, vocab), True)
    is_candidate = marks[:, :vocab]
    on_candidates = (dist * is_candidate).sum(dim=1)
    others = (dist * ~is_candidate).sum(dim=1)
    spend = torch.minimum(budget.to(dist.device), annealed(options.delta, options.decay, tree.depths.to(dist.device)))
    moved = torch.where(on_candidates > 0, torch.minimum(spend.to(dist.dtype), others), 0.0)
    tiny = torch.finfo(dist.dtype).tiny
    scale = torch.where(is_candidate, 1 + moved[:, None] / on_candidates.clamp(min=tiny)[:, None],
                        (1 - moved[:, None] / others.clamp(min=tiny)[:, None]).clamp(min=0))
    return dist * scale


@hookimpl
def accept(
    tree: DraftTree, dist: Tensor, scores: Scores, sampling: Sampling, generator: torch.Generator, exact: bool, options: CoolSDOptions
) -> Acceptance | None:
    if options.acceptance != "reject" or sampling.greedy or tree.size == 1:  # greedy: the core's argmax on p; no draft: a draw of p
        return None
    if tree.draft_probs is None or tree.child_ids.shape[1] > 1:
        raise SpecimgError("coolsd's acceptance=reject verifies a chain of sampled drafts: use --tree chain --sample-drafts, or sjd+coolsd")
    if dist is not scores.probs:
        raise SpecimgError("coolsd's acceptance=reject relaxes toward the draft itself and stacks with no other relaxation (its residual needs every token's acceptance)")
    delta = 0.0 if exact else options.delta
    budgets = annealed(delta, options.decay, tree.depths.to(dist.device))
    accept_prob, residual = relaxed_rejection(scores.probs, tree.draft_probs.to(dist.device), budgets)
    candidates, ids = (t.to(dist.device) for t in tree.candidates())
    child = candidates[:, 0].clamp(min=0)
    prob = torch.where(candidates[:, 0] >= 0, accept_prob.gather(1, child[:, None])[:, 0], 0.0)
    from_p = (ids[:, 0] < 0) | (residual.sum(dim=1) <= 0)  # the last node's bonus token; a rejection of probability 0
    return chain_acceptance(tree, prob, torch.where(from_p[:, None], scores.probs, residual), generator)


def relaxed_rejection(p: Tensor, q: Tensor, budgets: Tensor) -> tuple[Tensor, Tensor]:
    """C3 per node: the acceptance probability a [n, V] of every token as a draft and the
    optimal residual r* [n, V] (unnormalised, C1), for per-node TV budgets [n]."""
    p64, q64 = p.double(), q.double()
    gap = tvd(p64, q64)
    weight = torch.where(gap > 0, (budgets.to(gap) / gap.clamp(min=torch.finfo(gap.dtype).tiny)).clamp(max=1.0), 0.0)
    accepted = torch.minimum(q64, p64) + weight[:, None] * (q64 - p64).clamp(min=0)  # q * a
    accept_prob = torch.where(q64 > 0, accepted / q64.clamp(min=torch.finfo(q64.dtype).tiny), 1.0).clamp(max=1.0)
    return accept_prob.to(p.dtype), (p64 - accepted).clamp(min=0).to(p.dtype)
