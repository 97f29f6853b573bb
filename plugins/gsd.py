"""gsd: Grouped Speculative Decoding (So et al., ICCV 2025), made tree-aware.

Image targets spread their mass over groups of visually interchangeable tokens, and which
tokens group together depends on the context, so the groups are formed per node from the
target's own distribution rather than from a fixed clustering.  Per tree node u, for each
child c of u in draft-rank order:

    G(c)    = tokens t within +-w ranks of c in p_u's order with
              |p_u(t) - p_u(c)| < p_thr  and  cos(E_t, E_c) >= emb_thr
              (E = the target's input embeddings), closest in rank first
    q_R(c) += mass of G(c) under p_u, while the node's budget delta lasts
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v
from torch import Tensor

from specimg import DraftTree, MethodSpec, hookimpl
from specimg.models.base import Target
from specimg.relax import transfer


@attrs.frozen
class GSDOptions:
    """w: rank window; p_thr: largest probability gap to c; emb_thr: smallest cosine
    similarity of input embeddings to c (scale-free, unlike the paper's squared L2 < 0.5,
    which is tied to Lumina-mGPT's embedding scale); delta: TVD budget per node."""

    w: int = attrs.field(default=7, validator=v.ge(1))
    p_thr: float = 0.15
    emb_thr: float = 0.5
    delta: float = 0.5


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec("gsd", GSDOptions, "GSD: candidates take the mass of nearby-ranked, similar tokens, grouped per node"))


@hookimpl
def build_relaxed_dist(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, target: Target, options: GSDOptions
) -> Tensor:
    candidates = tree.candidates()[0].to(dist.device)
    donors = group_donors(target_dist, candidates, target.input_embeddings(), options)
    return transfer(dist, target_dist, candidates, donors, budget.to(dist.device), distinct=True)[0]


def group_donors(probs: Tensor, candidates: Tensor, embeddings: Tensor, options: GSDOptions) -> Tensor:
    """G(c) for every candidate at once: donors [n, C, 2w], -1 where none.  Only nodes
    with children are ranked (one sort of their rows)."""
    n, width = candidates.shape
    vocab = probs.shape[-1]
    donors = torch.full((n, width, 2 * options.w), -1, dtype=torch.long, device=probs.device)
    rows = (candidates >= 0).any(dim=1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return donors
    p = probs[rows]
    cand = candidates[rows]
    safe = cand.clamp(min=0)
    order = p.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(vocab, device=p.device).expand_as(order))
    steps = torch.arange(1, options.w + 1, device=p.device)
    offsets = torch.stack([-steps, steps], dim=1).flatten()  # -1, +1, -2, +2, ...: closest rank first, likelier side first
    pos = rank.gather(1, safe)[..., None] + offsets
    inside = (pos >= 0) & (pos < vocab)
    tokens = order.gather(1, pos.clamp(0, vocab - 1).flatten(1)).view_as(pos)
    p_close = (p.gather(1, tokens.flatten(1)).view_as(tokens) - p.gather(1, safe)[..., None]).abs() < options.p_thr
    emb = embeddings.to(p.device)
    e_cand = F.normalize(emb[safe].float(), dim=-1)
    e_tok = F.normalize(emb[tokens].float(), dim=-1)
    e_close = torch.einsum("mcd,mckd->mck", e_cand, e_tok) >= options.emb_thr
    keep = inside & p_close & e_close & (cand >= 0)[..., None]
    donors[rows] = torch.where(keep, tokens, torch.full_like(tokens, -1))
    return donors
