"""What one decode step produces and passes between hooks."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from specimg.tree import DraftTree


class Scores(NamedTuple):
    """The target's verdict on a tree, per node: the processed next-token distribution
    ``probs`` [n, V] (float32; at temperature 0 the temperature-1 distribution), and per row
    (row 0 conditional) the last hidden states ``hidden`` [rows, n, D] and raw ``logits``
    [rows, n, V]; ``layers`` the exposed layers' states [rows, n, k * D] when the target
    exposes any (an EAGLE-3 drafter's features), else None."""

    probs: Tensor
    hidden: Tensor
    logits: Tensor
    layers: Tensor | None = None


class Acceptance(NamedTuple):
    """The accepted root-to-node ``path`` of tree node ids (starting with the root) and the
    ``next_token`` drawn after it (a correction, or the bonus token at a leaf)."""

    path: list[int]
    next_token: int


class Step(NamedTuple):
    """One finished step of an image: its tree, the target's scores on it and what was
    accepted.  Before an image's first step, the prefill as a one-node step (the root, with
    the prefill's distribution, whose draw was image token 0)."""

    tree: DraftTree
    scores: Scores
    acceptance: Acceptance
