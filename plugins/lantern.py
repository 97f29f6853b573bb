"""lantern: LANTERN (Jang et al., ICLR 2025), relaxed acceptance by latent proximity.

Image tokens whose codebook vectors lie close decode to nearly the same patch, so a
drafted token may take the probability of its latent neighbours.  Per tree node u, for
each child c of u in draft-rank order:

    B_k(c)  = the k codes nearest to c in the tokenizer's codebook (L2, nearest first)
    q_R(c) += mass of B_k(c) under p_u, nearest first, while the node's budget delta lasts
              (whole neighbours only by default: the longest prefix that fits)

The moved mass leaves the neighbours, so q_R,u stays a distribution within delta of p_u.
Two of the paper's choices are options: neighbours in the raw codebook (its released code)
rather than the normalised one the decoder sees, and a budget delta per candidate rather
than per node (then a node with C candidates moves up to C * delta, so the method
declares a node budget of 1).

``mode="paper"`` is the rule of the released code (jadohu/LANTERN), neighbours in the raw
codebook, with no TVD budget (``LanternOptions.budgeted`` is False); the tree chooses
which released path.  At node u with children x_1, x_2, ... in draft-rank order, r
starting as p_u, for each child x in turn:

    A(x)    = the longest prefix of B_k(x) with r(A(x)) <= delta   (delta per candidate)
    accept x with probability min(1, (r(x) + r(A(x))) / q(x))
    else      r <- norm(max(0, r - q) with x set to 0, and, where A(x) is not empty
                   (as an index set: its first neighbour fits), ALL of B_{k+1}(x) too)
              (r <- uniform over the vocabulary where nothing is left)
              q <- norm(q without x)
    every child rejected: emit y ~ r

On a sampled tree, q is the drafter's distribution the children were drawn from: the
Lumina-mGPT path (models/ea_model_lumina_mgpt.py, ``evaluate_posterior``, EAGLE-1
trees).  On a top-k tree (EAGLE-2's, the LlamaGen path: models/ea_model_llamagen.py,
``evaluate_posterior``) the drafts are deterministic, q = 1: x is accepted with
min(1, r(x) + r(A(x))) and a rejection zeroes x (and B_{k+1}(x) where A(x) is not empty)
in r.  Its default tree is the release's (``RELEASED_TREE``).  ``nearest_latents[x, :k]``
gives A(x), ``nearest_latents[x, :k+1]`` is zeroed only ``if indices != -1``, and
``torch.ones_like(gtp)`` is the empty residual's uniform; ``nearest_latents`` holds each
code's nearest other codes (entrypoints/generate_codebook.py sets the diagonal to inf).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from attrs import validators as v
from torch import Tensor

from specimg import CODEBOOKS, DraftTree, MethodSpec, SpecimgError, TreeConfig, codebook_donors, hookimpl, transfer

BUDGETS = ("node", "candidate")
MODES = ("specimg", "paper")
RELEASED_TREE = {"depth": 4, "topk": 10, "total_tokens": 59}
"""The EAGLE-2 tree of the release's LlamaGen runs (``EaModel.from_pretrained`` in
models/ea_model_llamagen.py: total_token 59, depth 4, top_k 10)."""


@attrs.frozen
class LanternOptions:
    """k: neighbours per token; delta: TVD budget per node (or per candidate);
    whole_neighbours: move a neighbour's whole mass or none of it (the paper's rule);
    codebook: neighbours in the vectors the decoder sees or in the raw codebook (the
    released code's); budget: one delta per node, or per candidate (the paper's).
    mode: "specimg" (the above) or "paper" (the released code's rule, module docstring:
    k and delta as given, the raw codebook; whole_neighbours, codebook and budget are
    refused, since it does not use them)."""

    k: int = attrs.field(default=1000, validator=v.ge(1))
    delta: float = attrs.field(default=0.1, validator=[v.ge(0.0), v.le(1.0)])
    whole_neighbours: bool = True
    codebook: str = attrs.field(default="normalised", validator=v.in_(CODEBOOKS))
    budget: str = attrs.field(default="node", validator=v.in_(BUDGETS))
    mode: str = attrs.field(default="specimg", validator=v.in_(MODES))

    def ignores(self) -> tuple[str, tuple[str, ...]]:
        """The options this mode does not use (given, they are refused)."""
        return f"mode={self.mode}", ("whole_neighbours", "codebook", "budget") if self.mode == "paper" else ()

    def released_tree(self, tree: TreeConfig) -> TreeConfig:
        """In paper mode, a tree left to the engine (auto) is the release's EAGLE-2 tree."""
        if self.mode != "paper" or tree.kind != "auto":
            return tree
        return attrs.evolve(tree, kind="dynamic", **RELEASED_TREE)

    @property
    def node_delta(self) -> float:
        """The TVD the stack may spend at a node for this method: delta, or 1 where nothing
        bounds a node (a budget per candidate: C candidates may move C * delta; the paper's
        rule: no budget at all)."""
        if self.mode == "paper":
            return 1.0
        return self.delta if self.budget == "node" or self.delta == 0 else 1.0

    @property
    def budgeted(self) -> bool:
        """Whether every node stays within its budget in TVD (the released rule has none)."""
        return self.mode == "specimg"


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "lantern", LanternOptions, "LANTERN: candidates take the mass of their k nearest codebook neighbours", paper={"mode": "paper"},
        departures=(
            "the paper budgets delta per candidate and zeroes a rejected draft's k+1 nearest codes in the residual, so a node may "
            "move more than delta; specimg's default shares one delta per node, in the decoder's normalised codebook. mode=paper "
            "runs on the release's LlamaGen tree (EAGLE-2, depth 4, top-k 10, 59 nodes; q = 1) where the tree is left to auto, "
            "and takes the Lumina-mGPT rule (the drafter's q) on sampled trees (--sample-drafts)"
        ),
        batch=True,
    ))


@hookimpl
def build_relaxed_dist(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, tokenizer: Any, options: LanternOptions
) -> Tensor:
    candidates = tree.candidates()[0].to(dist.device)
    raw = options.mode == "paper" or options.codebook == "raw"
    if options.mode == "paper":  # k nearest for A(x), k + 1 for what a rejection zeroes
        near = codebook_donors(tokenizer, candidates, options.k + 1, target_dist.shape[-1], "lantern", raw=True)
        return released_law(dist, target_dist, budget, tree, near, options.k, lambda mass: torch.full_like(mass, options.delta), "lantern")
    donors = codebook_donors(tokenizer, candidates, options.k, target_dist.shape[-1], "lantern", raw=raw)
    # a candidate's mass changes only in its own turn, so capping it at its mass + delta gives it a budget of its own
    cap = dist.gather(1, candidates.clamp(min=0)) + options.delta if options.budget == "candidate" else None
    return transfer(dist, target_dist, candidates, donors, budget.to(dist.device), cap=cap, whole=options.whole_neighbours, distinct=True)[0]


def released_law(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, near: Tensor, k: int, allowance: Callable[[Tensor], Tensor],
    method: str, zero_in_q: bool = False,
) -> Tensor:
    """The law of the token the released rule emits at each node, given the children
    drafted there, as q_R [n, V]: the core's sample-and-match then emits exactly that law,
    a child's token drawn being that child accepted.  ``near`` [n, C, k + 1] holds each
    child's k + 1 nearest codes: A(x) is a prefix of the first ``k`` with mass at most
    ``allowance(r(x))`` (LANTERN: delta; LANTERN++: (lam - 1) r(x)).  A top-k tree (no
    draft distributions) takes the LlamaGen EAGLE-2 rule, q = 1: a rejection zeroes x, and
    x's k + 1 nearest where A(x) is not empty, in r.  A sampled tree tests x against the
    drafter's q; a rejection sets r to max(0, r - q) with x and, where A(x) is not empty,
    its k + 1 nearest zeroed (Lumina-mGPT's path), or with ``zero_in_q`` (LANTERN++'s
    static-tree path, ``evaluate_posterior_v1``) zeroes those k + 1 nearest in q before
    subtracting it, and not x.  Where a rejection leaves r no mass, r becomes uniform over the
    vocabulary (the release's ``torch.ones_like(gtp)``), so the law may leave p's support,
    as the release's does; so may a draft the target masks, accepted with r(A(x)) / q(x)."""
    candidates = tree.candidates()[0].to(target_dist.device)
    rows = (candidates >= 0).any(dim=1).nonzero().squeeze(1)
    if rows.numel() == 0:  # nothing drafted (the image's last token): p as it is
        return target_dist
    if dist is not target_dist or bool((budget < 1).any()):  # the rule tests drafts against p itself, unbounded
        raise SpecimgError(f"{method} mode=paper has no TVD budget: run it alone or first in a stack, with no --delta below 1")
    law = target_dist.clone()
    r = target_dist[rows].double()
    q = None if tree.draft_probs is None else tree.draft_probs.to(r.device)[rows].double()
    emitted = torch.zeros_like(r)
    reach = torch.ones(rows.numel(), dtype=r.dtype, device=r.device)  # P(every earlier child rejected)
    at = torch.arange(rows.numel(), device=r.device)
    tiny = torch.finfo(r.dtype).tiny
    uniform = torch.full_like(r, 1.0 / r.shape[-1])
    for j in range(candidates.shape[1]):
        drafted = candidates[rows, j] >= 0
        x, ball = candidates[rows, j].clamp(min=0), near[rows, j].clamp(min=0)
        mass = r.gather(1, ball[:, :k])
        fits = mass.cumsum(1) <= allowance(r[at, x])[:, None]  # a prefix: r >= 0
        lifted = r[at, x] + (mass * fits).sum(1)  # r(x) + r(A(x))
        drawn = 1.0 if q is None else q[at, x].clamp(min=tiny)
        accept = torch.where(drafted, (lifted / drawn).clamp(max=1.0), 0.0)
        emitted[at, x] += reach * accept
        reach = reach * (1 - accept)
        hood = torch.zeros_like(r, dtype=torch.bool).scatter_(1, ball, True) & fits[:, :1]  # A(x) not empty: x's k + 1 nearest
        if q is None:
            left = r.masked_fill(hood, 0.0).scatter(1, x[:, None], 0.0)
        elif not zero_in_q:
            left = (r - q).clamp(min=0).masked_fill(hood, 0.0).scatter(1, x[:, None], 0.0)
        else:
            left = (r - q.masked_fill(hood, 0.0)).clamp(min=0)
        total = left.sum(1, keepdim=True)
        r = torch.where(drafted[:, None], torch.where(total > 0, left / total.clamp(min=tiny), uniform), r)
        if q is not None:
            dropped = q.scatter(1, x[:, None], 0.0)
            kept = dropped.sum(1, keepdim=True)
            q = torch.where(drafted[:, None] & (kept > 0), dropped / kept.clamp(min=tiny), q)
    law[rows] = (emitted + reach[:, None] * r).to(law.dtype)
    return law
