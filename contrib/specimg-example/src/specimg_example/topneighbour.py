"""topneighbour: give each drafted token the mass of the target's most probable other tokens.

Per tree node u, for each child c of u in draft-rank order:

    D(c)    = the k tokens of highest p_u that are not children of u, most probable first
    q_R(c) += mass of D(c), while the node's budget lasts and q_R(c) <= max_ratio * p_u(c)

Most probable first spends the budget where the target is least sure between its top
tokens; the cap keeps a token the target finds unlikely from becoming likely.  The mass
moves with ``specimg.relax.transfer``, which keeps the contract (a distribution, zero where
p is, within budget, mass only onto candidates).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from attrs import validators as v
from torch import Tensor

from specimg import DraftTree, MethodSpec, hookimpl, transfer


@attrs.frozen
class TopNeighbourOptions:
    """delta: total-variation budget per node; k: donors per candidate; max_ratio: cap on
    q_R(c) / p(c)."""

    delta: float = attrs.field(default=0.2, validator=[v.ge(0.0), v.le(1.0)])
    k: int = attrs.field(default=4, validator=v.ge(1))
    max_ratio: float = attrs.field(default=2.0, validator=v.ge(1.0))


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "topneighbour", TopNeighbourOptions, "drafted tokens take the mass of the target's most probable other tokens, capped",
        batch=True,  # the rule acts node by node, so a forest of several images' trees relaxes in one call
    ))


@hookimpl
def build_relaxed_dist(dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, options: TopNeighbourOptions) -> Tensor:
    candidates = tree.candidates()[0]
    n, vocab = target_dist.shape
    index = torch.where(candidates >= 0, candidates, vocab)  # a spare column for "no candidate"
    is_candidate = torch.zeros(n, vocab + 1, dtype=torch.bool, device=target_dist.device).scatter_(1, index, True)[:, :vocab]
    ranked = target_dist.masked_fill(is_candidate, -1.0).topk(min(options.k, vocab), dim=-1).indices
    donors = ranked[:, None, :].expand(-1, candidates.shape[1], -1)
    cap = options.max_ratio * target_dist.gather(1, candidates.clamp(min=0))
    return transfer(dist, target_dist, candidates, donors, budget, cap=cap)[0]
