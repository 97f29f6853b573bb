"""lantern: LANTERN (Jang et al., ICLR 2025), relaxed acceptance by latent proximity.

Image tokens whose codebook vectors lie close decode to nearly the same patch, so a
drafted token may take the probability of its latent neighbours.  Per tree node u, for
each child c of u in draft-rank order:

    B_k(c)  = the k codes nearest to c in the tokenizer's codebook (L2, nearest first)
    q_R(c) += mass of B_k(c) under p_u, nearest first, while the node's budget delta lasts
              (paper mode: whole neighbours only, the longest prefix that fits)

The moved mass leaves the neighbours, so q_R,u stays a distribution within delta of p_u.
Two of the paper's choices are options: neighbours in the raw codebook (its released code)
rather than the normalised one the decoder sees, and a budget delta per candidate rather
than per node (then a node with C candidates moves up to C * delta, so the method
declares a node budget of 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from attrs import validators as v
from torch import Tensor

from specimg import CODEBOOKS, DraftTree, MethodSpec, codebook_donors, hookimpl, transfer

BUDGETS = ("node", "candidate")


@attrs.frozen
class LanternOptions:
    """k: neighbours per token; delta: TVD budget per node (or per candidate);
    whole_neighbours: move a neighbour's whole mass or none of it (the paper's rule);
    codebook: neighbours in the vectors the decoder sees or in the raw codebook (the
    released code's); budget: one delta per node, or per candidate (the paper's)."""

    k: int = attrs.field(default=1000, validator=v.ge(1))
    delta: float = attrs.field(default=0.1, validator=[v.ge(0.0), v.le(1.0)])
    whole_neighbours: bool = True
    codebook: str = attrs.field(default="normalised", validator=v.in_(CODEBOOKS))
    budget: str = attrs.field(default="node", validator=v.in_(BUDGETS))

    @property
    def node_delta(self) -> float:
        """The TVD the stack may spend at a node for this method: delta, or with a budget per
        candidate 1 (no bound of its own: C candidates may move C * delta)."""
        return self.delta if self.budget == "node" or self.delta == 0 else 1.0


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec("lantern", LanternOptions, "LANTERN: candidates take the mass of their k nearest codebook neighbours"))


@hookimpl
def build_relaxed_dist(
    dist: Tensor, target_dist: Tensor, budget: Tensor, tree: DraftTree, tokenizer: Any, options: LanternOptions
) -> Tensor:
    candidates = tree.candidates()[0].to(dist.device)
    donors = codebook_donors(tokenizer, candidates, options.k, target_dist.shape[-1], "lantern", raw=options.codebook == "raw")
    # a candidate's mass changes only in its own turn, so capping it at its mass + delta gives it a budget of its own
    cap = dist.gather(1, candidates.clamp(min=0)) + options.delta if options.budget == "candidate" else None
    return transfer(dist, target_dist, candidates, donors, budget.to(dist.device), cap=cap, whole=options.whole_neighbours, distinct=True)[0]
