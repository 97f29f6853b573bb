"""The contracts between the engine and the models it drives.

A *target* is the model being accelerated; a *drafter* proposes tokens for it.  Both keep
their own KV caches. Rows: when classifier-free guidance is on, every call works on two
rows, row 0 conditional and row 1 unconditional (LlamaGen's order), and returns both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, Union, runtime_checkable

import attrs
import torch
from torch import Tensor

from specimg.errors import SpecimgError


@attrs.frozen(eq=False)
class Caption:
    """A text condition for a t2i target: encoder features [L, D] and a validity mask [L]."""

    features: Tensor
    mask: Tensor


PromptIds = tuple[int, ...]
"""A whole prompt as token ids, for a target that tokenizes texts itself: what its
``prompt_ids`` makes of a text (template and special tokens included), so a folder without
a text tokenizer can still be prompted."""

Condition = Union[int, Caption, str, PromptIds]
"""A class label (c2i), a caption (LlamaGen t2i), or a prompt text or its ids (a target that tokenizes texts)."""


def takes_text(target: object) -> bool:
    """Whether a target tokenizes prompt texts itself (its ``prompt_ids``: Janus, Lumina-mGPT)
    rather than taking class labels or a text encoder's captions; it also takes prompt ids."""
    return callable(getattr(target, "prompt_ids", None))


class TargetOutput(NamedTuple):
    """Per row and node: raw next-token logits [rows, n, V] (float32), the last hidden
    state after the final norm [rows, n, D] and, when the target was asked for them
    (``expose_layers``: an EAGLE-3 drafter's features), the inputs of those layers side by
    side [rows, n, k * D] (None otherwise, so that an EAGLE-1 run pays nothing for them)."""

    logits: Tensor
    hidden: Tensor
    layers: Tensor | None = None


@runtime_checkable
class Target(Protocol):
    """An AR image model the engine can verify draft trees with.

    The cache holds the condition and every committed image token.  ``forward_tree``
    appends nothing permanently: the tree's entries stay provisional until ``commit``
    keeps a root-to-node path of them.  A target may also run its step forwards at fixed
    shapes and as CUDA graphs (``set_step_mode``, :class:`specimg.compiled.FixedSteps`).
    """

    vocab_size: int
    """Size of the image-token vocabulary (the codebook size)."""
    num_tokens: int
    """Image tokens per image (e.g. 256 for a 16x16 grid)."""
    hidden_size: int

    def prefill(self, condition: Condition, cfg: bool) -> TargetOutput:
        """Reset the cache and consume the condition; return the outputs at the last
        condition position (n = 1), whose logits give the first image token."""

    def forward_tree(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        """Run tree nodes against the committed prefix in one pass.

        tokens [n] (long), depths [n] (node i sits at position committed + depths[i]),
        mask [n, n] bool (mask[i, j]: node i attends to node j, its ancestors and itself).
        """

    def commit(self, nodes: Tensor) -> None:
        """Keep the cache entries of tree nodes ``nodes`` (a root-to-node path, in order)
        from the last ``forward_tree`` and drop the rest."""

    def input_embeddings(self) -> Tensor:
        """The image-token input embedding table [V, D] (read-only view)."""


@runtime_checkable
class BatchSteps(Protocol):
    """A target that decodes several images in one forward per token (AR at a batch size
    above 1).  It keeps their cache apart from the tree cache of ``prefill``; image i's
    rows sit at index i of the batch dimension."""

    def prefill_batch(self, conditions: Sequence[Condition], cfg: bool, tree_nodes: int = 0) -> TargetOutput:
        """Start one image per condition, with room for trees of up to ``tree_nodes``
        nodes: the outputs at the last condition position, logits [rows, B, V] and states
        [rows, B, ...]."""

    def forward_batch(self, tokens: Tensor) -> Tensor:
        """Consume each image's next token (tokens [B]; every image at the same length);
        raw logits [rows, B, V] for the token after it."""


@runtime_checkable
class BatchTrees(BatchSteps, Protocol):
    """A batch target that also verifies one tree per image in one forward (speculative
    decoding at a batch size above 1); the images' committed lengths may differ."""

    def forward_trees(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        """Image i's tree: tokens and depths [B, n], ancestor mask [B, n, n] (node 0 its
        root, the last committed token; a tree smaller than n padded with nodes that see
        only themselves).  Outputs per node, logits [rows, B, n, V] and states
        [rows, B, n, ...], as ``forward_tree``'s are for one image."""

    def commit_trees(self, paths: Sequence[Tensor]) -> None:
        """Keep image i's accepted nodes ``paths[i]`` (root first; empty: nothing) of the
        last ``forward_trees``."""

    def refill(self, image: int, condition: Condition) -> TargetOutput:
        """Start a new image in the place of image ``image`` (one that finished), the
        others untouched: outputs [rows, 1, ...] at its last condition position, as
        ``prefill``'s."""


@runtime_checkable
class Drafter(Protocol):
    """A cheap model that proposes the next tokens given the target's features.

    Draft nodes are fed in a tree: ``start`` consumes the newly committed tokens and
    returns the logits for the root's children; ``expand`` feeds further nodes, each a
    child of an already fed node, and returns the logits for their children.  Every
    ``start`` forgets all speculative nodes of the previous step (free rollback).
    """

    def prefill(self, condition: Condition, cfg: bool) -> None:
        """Reset for a new image with this condition."""

    def start(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Commit m new positions: ``hidden`` [rows, m, D] the target's states at the
        positions before ``tokens`` [m] (the first call after ``prefill`` gets the state at
        the last condition position and the first image token); the last token is the new
        tree root.
        Returns the logits [rows, V] for the root's children (the root is drafter node 0)."""

    def expand(self, parents: Tensor, tokens: Tensor) -> Tensor:
        """Feed nodes with tokens [f], children of drafter nodes ``parents`` [f] (0 = root,
        i = the i-th node fed since ``start``, counting from 1).  Returns logits [rows, f, V]."""


def exposed_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` checked against a target of ``num_layers`` layers: layer i's input is the
    state after i layers (0: the token embeddings)."""
    layers = tuple(int(i) for i in layers)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise SpecimgError(f"layer {bad[0]} is not among this target's {num_layers} layers [0, {num_layers})")
    return layers


class Features(Protocol):
    """What a drafter's features come from: a target's output, or a step's scores."""

    hidden: Tensor
    layers: Tensor | None


def draft_features(drafter: object, out: Features) -> Tensor:
    """What ``drafter.start`` takes from a target's output: its last hidden states, or the
    exposed layers' states for a drafter that names ``feature_layers`` (EAGLE-3)."""
    if not getattr(drafter, "feature_layers", None):
        return out.hidden
    if out.layers is None:
        raise SpecimgError("this drafter reads the target's layers, which the target did not expose (expose_layers)")
    return out.layers


def cfg_rows(cfg: bool) -> int:
    return 2 if cfg else 1


def causal_tree_mask(n: int, device: torch.device | str = "cpu") -> Tensor:
    """The mask of a chain: every node attends to itself and all earlier nodes."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def placed(model: object, device: torch.device | str | None, dtype: torch.dtype | None = None) -> object:
    """``model`` on ``device`` (and in ``dtype``, floating weights only) if it is a torch
    module; anything else is returned as it is (a tokenizer that shares the target's
    weights, such as Janus's VQ model, moves with the target)."""
    if not isinstance(model, torch.nn.Module):
        return model
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)


@attrs.frozen(eq=False)
class Models:
    """What a run decodes with: a target, its drafter (None: ``ar`` only), what decodes the
    target's codes into images (``decode(codes)``; None: tokens only), and the name runs
    record them under."""

    target: Target
    drafter: Drafter | None
    tokenizer: Any
    name: str
