"""An image's acceptance profile: how likely the rank-r child of a reached node at depth d
is accepted, from a prior and the image's own steps.  The prior is the method's acceptance
measured when its cost model was calibrated, or, before that, a weak guess.  The planner
values trees with it; the cost model times its bookkeeping as part of a step's overhead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from specimg.tree import DraftTree

MAX_DEPTH = 10
MAX_TOPK = 10
PRIOR_FIRST, PRIOR_DECAY, PRIOR_WEIGHT = 0.5, 0.5, 2.0
"""The weak prior: the rank-r child is accepted with probability 0.5 * 0.5**r.  Any prior
is worth two observed visits."""


class AcceptanceProfile:
    """Running acceptance chances per (depth, rank), kept on the decode's device so that
    observing a step costs no host round trip.  ``prior`` [depth, rank]: the chances
    measured beforehand (``measured`` is then true), else the weak guess."""

    def __init__(self, device: torch.device | str = "cpu", depth: int = MAX_DEPTH, width: int = MAX_TOPK, prior: np.ndarray | None = None):
        self.measured = prior is not None
        prior = np.tile([PRIOR_FIRST * PRIOR_DECAY**r for r in range(width)], (depth, 1)) if prior is None else np.asarray(prior, dtype=np.float64)
        if prior.shape != (depth, width):
            raise ValueError(f"an acceptance prior of shape {prior.shape} for a profile of {(depth, width)}")
        self.prior = prior
        self.sums = torch.zeros(depth, width, dtype=torch.float64, device=device)  # observed chances
        self.counts = torch.zeros(depth, width, dtype=torch.float64, device=device)  # observed visits

    @classmethod
    def pooled(cls, profiles: Sequence[AcceptanceProfile]) -> AcceptanceProfile:
        """One profile of every step the ``profiles`` observed, on the first one's prior."""
        first = profiles[0]
        pool = cls(first.sums.device, *first.sums.shape, prior=first.prior if first.measured else None)
        for profile in profiles:
            pool.sums += profile.sums.to(pool.sums.device)
            pool.counts += profile.counts.to(pool.counts.device)
        return pool

    def observe(self, tree: DraftTree, dist: Tensor, path: Sequence[int] | Tensor, greedy: bool) -> None:
        """Add one step: at each node of the walked ``path`` (node ids, or their tensor on
        the device), the chance each child had."""
        depth, width = self.sums.shape
        nodes = torch.as_tensor(path, device=dist.device)
        ids = tree.child_ids[nodes, :width]
        tokens = tree.tokens[ids.clamp(min=0)]
        rows = dist[nodes]
        chance = ((rows.argmax(dim=-1, keepdim=True) == tokens) if greedy else rows.gather(1, tokens)).double()
        seen = (ids >= 0).double()
        levels = torch.arange(len(path), device=dist.device).clamp_(max=depth - 1)
        self.sums[:, : ids.shape[1]].index_add_(0, levels, chance * seen)
        self.counts[:, : ids.shape[1]].index_add_(0, levels, seen)

    def rates(self) -> np.ndarray:
        """[depth, rank] acceptance chances, non-increasing in rank (a drafter's rank-r
        token is never likelier than its rank-(r-1) one, up to noise).  On the weak prior,
        a depth the trees have rarely reached borrows the rank's chance pooled over all
        depths (worth PRIOR_WEIGHT visits), so an unexplored depth is neither hopeless nor
        free; a measured prior knows every depth already (it borrowed when it was
        measured), so an unvisited cell keeps it."""
        sums = self.sums.cpu().numpy() + PRIOR_WEIGHT * self.prior
        counts = self.counts.cpu().numpy() + PRIOR_WEIGHT
        if self.measured:
            return np.minimum.accumulate(sums / counts, axis=1)
        pooled = sums.sum(axis=0) / counts.sum(axis=0)
        rates = (sums + PRIOR_WEIGHT * pooled) / (counts + PRIOR_WEIGHT)
        return np.minimum.accumulate(rates, axis=1)
