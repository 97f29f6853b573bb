"""coolsd: COOL-SD, annealed relaxation of speculative decoding (Li, Zhang, Du, Ji; AAAI
2026, arXiv 2601.09212).

The rule as published.  The paper's HTML (arxiv.org/html/2601.09212v1) could be read
only up to its introduction here; the method below is taken from a detailed paper note
(en.papernotes.org, AAAI2026 image_generation, "annealed_relaxation_of_speculative_
decoding_for_faster_autor"), with the schedule's normalisation read from a second
secondary summary.  The paper's equation numbers were not available: each piece is named
by the paper's theorem or proposition, and by the labels E1-E3 this module uses.

E1, the relaxed acceptance (paper: the parameterised acceptance criterion).  Draft token
    x_i ~ Q at draft position i is accepted with probability

        f_i = min(1, omega_i * P(x_i) / Q(x_i))

    omega_i > 1 relaxes, omega_i = 1 is vanilla speculative sampling.
E2, the optimal resampling distribution (paper: Theorem 2, which bounds the TV distance
    between the decoded and the target law for any acceptance f and is minimised by)

        G*_i = Norm([P - Q * f_i]_+)

    Proposition 1: where f_i >= vanilla's min(1, P/Q) (omega_i >= 1), G*_i is vanilla's
    Norm([P - Q]_+).  It is not where omega_i < 1, and there G*_i makes the position
    exact.  At one position the law emitted, Q f + beta G*, is exactly
    sum_y (Q f_i - P)^+ = sum_y (min(Q, omega_i P) - P)^+ from P, the least any residual
    reaches (this module's statement of the bound at L = 1, checked in the tests).
E3, the annealing (paper: Proposition 2, relax early positions more than late ones at a
    fixed expected accepted length; the exponential schedule)

        omega_i = delta * exp(-nu * i - mu),   i = 1 ... L

    delta sets the overall relaxation (option ``omega``: specimg's ``delta`` is a TVD
    budget), nu = 0.7 the decay.  mu normalises the schedule to
    mean delta over the L draft positions (mu = log mean_j exp(-nu j)), as a secondary
    summary describes it ("average-normalised"); its exact form is this module's reading.
    So late positions can get omega_i < 1: tighter than vanilla, exact there (E2).

Published settings: delta 1.1 (LlamaGen-XL and Lumina-mGPT) and 2 (LlamaGen-XL), nu 0.7,
on EAGLE-1 drafts.  The paper's draft trees were not described in the sources, so
``acceptance="reject"`` runs E1-E3 on a chain of sampled drafts (a drafter's sampled chain,
or sjd's windows: sjd+coolsd), L being the chain's length.  Its residual needs every
token's acceptance under the plain target, so it stacks with no donor relaxation.

``acceptance="match"`` (the default, this module's extension to any tree) is E1-E2 for a
top-k draft through the core's sample-and-match.  A top-k candidate c is a point-mass
draft; E1-E2 then emit c with probability min(1, omega_i p(c)) and otherwise draw the rest
of p.  So at node u, verifying position i = depth + 1 of a tree whose deepest position is
L, the candidates' mass is scaled by omega_i and the rest of p scaled down to match,
within the budget left:

    m_u = min(budget_u, (omega_i - 1)^+ * dist(candidates), dist(others))
    q_R(c) = dist(c) * (1 + m_u / dist(candidates)),   q_R(y) = dist(y) * (1 - m_u / dist(others))   (E4)

With one candidate and the budget not binding this is E1-E2's law exactly.  It keeps the
budget contract and stacks after every relaxation (their donors first, then E4).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch
from attrs import validators as v
from torch import Tensor

from specimg import Acceptance, DraftTree, MethodSpec, Sampling, Scores, SpecimgError, chain_acceptance, hookimpl

ACCEPTANCES = ("match", "reject")
PAPER = {"acceptance": "reject", "omega": 1.1, "nu": 0.7}


@attrs.frozen
class CoolSDOptions:
    """omega: the paper's delta, the schedule's mean relaxation factor over the draft (E3;
    omega 1 with nu 0 is vanilla speculative sampling); nu: its decay rate per draft
    position; acceptance: "match" (E4 on any tree, the core's sample-and-match) or "reject"
    (E1-E2 as published, on sampled chains); delta: E4's TVD budget per node (specimg's
    budget contract; "reject" has none)."""

    omega: float = attrs.field(default=1.1, validator=v.gt(0.0))
    nu: float = attrs.field(default=0.7, validator=v.ge(0.0))
    delta: float = attrs.field(default=0.3, validator=[v.ge(0.0), v.le(1.0)])
    acceptance: str = attrs.field(default="match", validator=v.in_(ACCEPTANCES))

    @property
    def budgeted(self) -> bool:
        """Whether q_R keeps the per-node budget contract; "reject" is held to E2's
        per-position law instead, which its own tests check exactly."""
        return self.acceptance == "match"


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "coolsd", CoolSDOptions, "COOL-SD: an acceptance relaxed by a factor annealed along the draft, resampled from the TV-optimal residual",
        stacked_defaults={"sjd": {"acceptance": "reject"}},  # sjd's sampled chains: the rejection rule
        paper=PAPER,
        departures=(
            "published (per a secondary paper note; the arXiv text past its introduction was not read): acceptance min(1, omega_i P/Q) (E1), resampling Norm([P - Q f]_+) (E2, Theorem 2; Proposition 1), "
            "omega_i = delta exp(-nu i - mu) (E3, Proposition 2) with the paper's delta 1.1 (also 2 on LlamaGen-XL; "
            "coolsd.omega here, coolsd.delta being specimg's TVD budget) and nu 0.7; "
            "equation numbers unavailable, labels E1-E4 are plugins/coolsd.py's; mu (mean-normalising) and the tree "
            "handling are specimg's reading; the default acceptance=match (E4) carries E1-E2 to any tree within the "
            "per-node budget"
        ),
        batch=True,
    ))


def relaxation(delta: float, nu: float, positions: Tensor, lengths: Tensor) -> Tensor:
    """E3: omega_i for draft positions i (1 = a root's child) of drafts L positions long:
    delta exp(-nu i - mu) with exp(-mu) = 1 / mean_{j=1..L} exp(-nu j), so the mean is delta."""
    if nu == 0:
        return torch.full(positions.shape, delta, dtype=torch.float64, device=positions.device)
    length = lengths.double().clamp(min=1)
    mean_decay = -torch.expm1(-nu * length) / (length * -math.expm1(-nu))  # mean_j exp(-nu (j - 1))
    return delta * torch.exp(-nu * (positions.double() - 1)) / mean_decay


def draft_lengths(tree: DraftTree) -> Tensor:
    """Per node, its draft's length L: the deepest depth of the tree (of a forest's tree) it belongs to."""
    depths = tree.depths
    if tree.images is None:
        return depths.max().expand(depths.shape)
    deepest = torch.zeros(int(tree.images.max()) + 1, dtype=depths.dtype, device=depths.device)
    return deepest.scatter_reduce(0, tree.images.to(depths.device), depths, "amax")[tree.images.to(depths.device)]


def schedule(tree: DraftTree, options: CoolSDOptions, device: torch.device) -> Tensor:
    """omega per node, for the draft position its children verify (depth + 1)."""
    depths = tree.depths.to(device)
    return relaxation(options.omega, options.nu, depths + 1, draft_lengths(tree).to(device))


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
    raised = (schedule(tree, options, dist.device) - 1).clamp(min=0).to(dist.dtype) * on_candidates
    moved = torch.minimum(torch.minimum(budget.to(dist.device).to(dist.dtype), raised), others)
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
    omega = torch.ones(tree.size, dtype=torch.float64, device=dist.device) if exact else schedule(tree, options, dist.device)
    accept_prob, residual = relaxed_rejection(scores.probs, tree.draft_probs.to(dist.device), omega)
    candidates, ids = (t.to(dist.device) for t in tree.candidates())
    child = candidates[:, 0].clamp(min=0)
    prob = torch.where(candidates[:, 0] >= 0, accept_prob.gather(1, child[:, None])[:, 0], 0.0)
    from_p = (ids[:, 0] < 0) | (residual.sum(dim=1) <= 0)  # the last node's bonus token; a rejection of probability 0
    return chain_acceptance(tree, prob, torch.where(from_p[:, None], scores.probs, residual), generator)


def relaxed_rejection(p: Tensor, q: Tensor, omega: Tensor) -> tuple[Tensor, Tensor]:
    """E1 and E2 per node: the acceptance probability f [n, V] of every token as a draft and
    the optimal residual G* [n, V] (unnormalised), for per-node factors omega [n]."""
    p64, q64 = p.double(), q.double()
    accepted = torch.minimum(q64, omega.to(p64)[:, None] * p64)  # Q * f
    accept_prob = torch.where(q64 > 0, accepted / q64.clamp(min=torch.finfo(q64.dtype).tiny), 1.0).clamp(max=1.0)
    return accept_prob.to(p.dtype), (p64 - accepted).clamp(min=0).to(p.dtype)
