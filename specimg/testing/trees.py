"""Random draft trees for checking a target's tree verification against sequential decoding."""

from __future__ import annotations

import torch
from torch import Tensor

from specimg.tree import DraftTree


def random_tree(n: int, vocab: int, seed: int) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """tokens [n], depths [n], ancestor-or-self mask [n, n] and parents of a random tree whose
    node 0 is the root and every other node's parent has a smaller index (-1 for the root)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tree = DraftTree.from_parents([0] * n, parents)
    return torch.randint(0, vocab, (n,), generator=g), tree.depths, tree.mask, parents


def path_to(node: int, parents: list[int]) -> list[int]:
    """The root-to-node path of ``node``, root first."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]
