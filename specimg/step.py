"""What one decode step produces and passes between hooks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor

from specimg.config import Sampling
from specimg.models.base import TargetOutput
from specimg.sampling import cfg_active_at, probabilities
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

    def split(self, sizes: Sequence[int]) -> list[Scores]:
        """The scores of consecutive runs of ``sizes`` nodes (each image's tree in a forest's),
        one ``split_with_sizes`` per field (``Tensor.split`` wraps it in Python)."""
        fields = [self.probs.split_with_sizes(sizes), self.hidden.split_with_sizes(sizes, 1), self.logits.split_with_sizes(sizes, 1)]
        layers = [None] * len(sizes) if self.layers is None else self.layers.split_with_sizes(sizes, 1)
        return [Scores(*parts) for parts in zip(*fields, layers)]


def scores_of(out: TargetOutput, depths: Tensor, sampling: Sampling, token_index: int | Tensor) -> Scores:
    """The scores of a tree's nodes (at ``depths``) from the target's outputs on them
    (``forward_tree``'s, or the nodes picked out of ``forward_trees``), its root predicting
    image token ``token_index`` (for several trees' nodes, per node: the index its own
    tree's root predicts)."""
    return Scores(probabilities(out.logits, sampling, cfg_active_at(depths, sampling, token_index)), out.hidden, out.logits, out.layers)


class Walked(NamedTuple):
    """What a rule that walked the tree on the device hands the commit, so that it neither
    copies the path to the device nor reads the tokens back: the ``path`` and the step's
    ``new_tokens`` (the path's tokens after the root, then the next token) as device
    tensors, ``token_list``, those tokens as the walk's one read gave them, and ``spent``,
    the TVD of q_R to p summed over the path's nodes (0-dim, on the device) where the walk
    measured it (None: where q_R is p, or the engine measures it)."""

    path: Tensor
    new_tokens: Tensor
    token_list: list[int]
    spent: Tensor | None = None


class Acceptance(NamedTuple):
    """The accepted root-to-node ``path`` of tree node ids (starting with the root) and the
    ``next_token`` drawn after it (a correction, or the bonus token at a leaf); ``walked``
    where the rule walked on the device."""

    path: list[int]
    next_token: int
    walked: Walked | None = None


class Step(NamedTuple):
    """One finished step of an image: its tree, the target's scores on it and what was
    accepted.  Before an image's first step, the prefill as a one-node step (the root, with
    the prefill's distribution, whose draw was image token 0)."""

    tree: DraftTree
    scores: Scores
    acceptance: Acceptance
