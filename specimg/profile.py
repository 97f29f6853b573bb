"""An image's acceptance profile: how likely the rank-r child of a reached node at depth d
is accepted, from a weak prior and the image's own steps.  The planner values trees with
it; the cost model times its bookkeeping as part of a step's overhead."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from specimg.tree import DraftTree

MAX_DEPTH = 10
MAX_TOPK = 10
PRIOR_FIRST, PRIOR_DECAY, PRIOR_WEIGHT = 0.5, 0.5, 2.0
"""Before any step: the rank-r child is accepted with probability 0.5 * 0.5**r, worth two
observed visits."""


class AcceptanceProfile:
    """Running acceptance chances per (depth, rank), kept on the decode's device so that
    observing a step costs no host round trip."""

    def __init__(self, device: torch.device | str = "cpu", depth: int = MAX_DEPTH, width: int = MAX_TOPK):
        prior = torch.tensor([PRIOR_FIRST * PRIOR_DECAY**r for r in range(width)], dtype=torch.float64)
        self.sums = (PRIOR_WEIGHT * prior).repeat(depth, 1).to(device)
        self.counts = torch.full((depth, width), PRIOR_WEIGHT, dtype=torch.float64, device=device)

    def observe(self, tree: DraftTree, dist: Tensor, path: Sequence[int] | Tensor, greedy: bool) -> None:
        """Add one step: at each node of the walked ``path`` (node ids, or their tensor on
        the device), the chance each child had."""
        depth, width = self.sums.shape
        nodes = torch.as_tensor(path, device=dist.device)
        ids = tree.child_ids[nodes, :width]
        tokens = tree.tokens[ids.clamp(min=0)]
        rows = dist[nodes]
        if greedy:
            chance = (rows.argmax(dim=-1, keepdim=True) == tokens).double()
        else:
            chance = rows.gather(1, tokens).double()
        seen = (ids >= 0).double()
        levels = torch.arange(len(path), device=dist.device).clamp_(max=depth - 1)
        self.sums[:, : ids.shape[1]].index_add_(0, levels, chance * seen)
        self.counts[:, : ids.shape[1]].index_add_(0, levels, seen)

    def rates(self) -> np.ndarray:
        """[depth, rank] acceptance chances, non-increasing in rank (a drafter's rank-r
        token is never likelier than its rank-(r-1) one, up to noise).  A depth the trees
        have rarely reached borrows the rank's chance pooled over all depths (worth
        PRIOR_WEIGHT visits), so an unexplored depth is neither hopeless nor free."""
        sums, counts = self.sums.cpu().numpy(), self.counts.cpu().numpy()
        pooled = sums.sum(axis=0) / counts.sum(axis=0)
        rates = (sums + PRIOR_WEIGHT * pooled) / (counts + PRIOR_WEIGHT)
        return np.minimum.accumulate(rates, axis=1)
