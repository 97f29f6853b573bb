"""lantern: LANTERN (Jang et al., ICLR 2025), relaxed acceptance by latent proximity.

Image tokens whose codebook vectors lie close decode to nearly the same patch, so a
drafted token may take the probability of its latent neighbours.  Per tree node u, for
each child c of u in draft-rank order:

    B_k(c)  = the k codes nearest to c in the tokenizer's codebook (L2, nearest first)
    q_R(c) += mass of B_k(c) under p_u, nearest first, while the node's budget delta lasts
              (paper mode: whole neighbours only, the longest prefix that fits)

The moved mass leaves the neighbours, so q_R,u stays a distribution within delta of p_u.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from attrs import validators as v
from torch import Tensor

from specimg import MethodSpec, hookimpl
from specimg.neighbours import codebook_donors
from specimg.relax import transfer
from specimg.tree import DraftTree


@attrs.frozen
class LanternOptions:
    """k: neighbours per token; delta: TVD budget per node; whole_neighbours: move a
    neighbour's whole mass or none of it (the paper's rule)."""

    k: int = attrs.field(default=1000, validator=v.ge(1))
    delta: float = 0.1
    whole_neighbours: bool = True


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec("lantern", LanternOptions, "LANTERN: candidates take the mass of their k nearest codebook neighbours"))


@hookimpl
def build_relaxed_dist(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, tokenizer: Any, options: LanternOptions
) -> Tensor:
    candidates = tree.candidates()[0].to(dist.device)
    donors = codebook_donors(tokenizer, candidates, options.k, target_dist.shape[-1], "lantern")
    return transfer(dist, target_dist, candidates, donors, budget.to(dist.device), whole=options.whole_neighbours, distinct=True)[0]
