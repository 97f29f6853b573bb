"""Toy models whose next token depends only on the previous one.

Their output distributions can be enumerated exactly, so they prove samplers exact.
They follow the Target and Drafter contracts (batched steps too), so the engine drives them like real models;
each token's hidden state (its "feature") is a fixed vector per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from specimg.models.base import Condition, TargetOutput, cfg_rows


class MarkovTarget:
    """Next-token logits ``logits[prev]`` ([V, V]); the first token's are ``first_logits``
    [V].  With CFG the unconditional row uses ``uncond_logits`` / ``uncond_first`` (default:
    the conditional tables).  ``features`` [V, D] are the per-token hidden states."""

    def __init__(
        self,
        logits: Tensor,
        first_logits: Tensor,
        num_tokens: int,
        features: Tensor | None = None,
        uncond_logits: Tensor | None = None,
        uncond_first: Tensor | None = None,
    ):
        self.vocab_size = logits.shape[-1]
        self.num_tokens = num_tokens
        self.features = features if features is not None else torch.eye(self.vocab_size)
        self.hidden_size = self.features.shape[-1]
        self._tables = torch.stack([logits, uncond_logits if uncond_logits is not None else logits]).float()
        self._first = torch.stack([first_logits, uncond_first if uncond_first is not None else first_logits]).float()
        self._rows = 1

    def prefill(self, condition: Condition, cfg: bool) -> TargetOutput:
        self._rows = cfg_rows(cfg)
        return self.refill(0, condition)

    def forward_tree(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        logits = self._tables[: self._rows, tokens]
        return TargetOutput(logits, self.features[tokens].expand(self._rows, -1, -1).clone())

    def commit(self, nodes: Tensor) -> None:
        """Nothing is cached: the next distribution depends only on the last token."""

    def prefill_batch(self, conditions: Sequence[Condition], cfg: bool, tree_nodes: int = 0) -> TargetOutput:
        self._rows = cfg_rows(cfg)
        first = self._first[: self._rows, None, :].expand(-1, len(conditions), -1).clone()
        return TargetOutput(first, torch.zeros(self._rows, len(conditions), self.hidden_size))

    def forward_batch(self, tokens: Tensor) -> Tensor:
        return self._tables[: self._rows, tokens]

    def forward_trees(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        return TargetOutput(self._tables[: self._rows, tokens], self.features[tokens].expand(self._rows, -1, -1, -1).clone())

    def commit_trees(self, paths: Sequence[Tensor]) -> None:
        """Nothing is cached."""

    def refill(self, image: int, condition: Condition) -> TargetOutput:
        return TargetOutput(self._first[: self._rows, None, :].clone(), torch.zeros(self._rows, 1, self.hidden_size))

    def input_embeddings(self) -> Tensor:
        return self.features


class MarkovDrafter:
    """A drafter proposing from a fixed table ``logits[prev]`` [V, V] (both CFG rows alike)."""

    def __init__(self, logits: Tensor):
        self.vocab_size = logits.shape[-1]
        self.table = logits.float()
        self._rows = 1
        self._fed: list[int] = []  # every token fed since the last start: the nodes the tree limits must hold

    def prefill(self, condition: Condition, cfg: bool) -> None:
        self._rows = cfg_rows(cfg)

    def batch(self, size: int, cfg: bool) -> MarkovDraftBatch:
        return MarkovDraftBatch(self.table, cfg_rows(cfg))

    def start(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        self._fed = [int(tokens[-1])]
        return self.table[self._fed[0]].expand(self._rows, -1).clone()

    def expand(self, parents: Tensor, tokens: Tensor) -> Tensor:
        self._fed.extend(tokens.tolist())
        return self.table[tokens].expand(self._rows, -1, -1).clone()


class MarkovDraftBatch:
    """Several images' Markov drafting: each call answers every image from the table."""

    def __init__(self, table: Tensor, rows: int):
        self.table, self.rows = table, rows

    def reset(self, image: int) -> None:
        """Nothing is cached."""

    def start(self, requests: Mapping[int, tuple[Tensor, Tensor]]) -> dict[int, Tensor]:
        return {i: self.table[int(tokens[-1])].expand(self.rows, -1).clone() for i, (_, tokens) in requests.items()}

    def expand(self, requests: Mapping[int, tuple[Tensor, Tensor]]) -> dict[int, Tensor]:
        return {i: self.table[tokens].expand(self.rows, -1, -1).clone() for i, (_, tokens) in requests.items()}
