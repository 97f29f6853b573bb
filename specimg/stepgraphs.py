"""A step's own device programs, replayed as CUDA graphs.

Around its replayed forwards a step runs tensor programs of its own: growing a tree
(a drafter forward, a top-k and the frontier's bookkeeping per level) and relaxing the
target's scores cost a GPU over a hundred launches each, far more than the forwards;
turning the target's logits into distributions (guidance, filter, softmax) costs as
many launches as the forward's replay and its copies.  Each is a fixed-shape program
with no host read, so it is captured once per tree shape (:class:`~specimg.graphs.GraphSet`)
and then replays as one launch plus the copies of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import attrs
import torch
from torch import Tensor

from specimg.config import Sampling
from specimg.graphs import GraphSet, StepMode
from specimg.models.base import BatchTrees, Drafter, Target
from specimg.sampling import probabilities
from specimg.step import Scores
from specimg.tree import BatchSession, DraftSession, DraftTree, build_dynamic, build_dynamic_batch

TreeProgram = Callable[[DraftTree, Scores], Sequence[Tensor]]


def replay_on_tree(graphs: GraphSet, name: str, program: TreeProgram, tree: DraftTree, scores: Scores) -> Sequence[Tensor]:
    """``program(tree, scores)`` replayed from ``graphs``, one graph per tree shape (its
    tensors' shapes and dtypes, its height, whether it is sampled and a forest's sizes).
    The tree's and the scores' tensors are the graph's inputs, copied in at each replay;
    the results are the graph's own outputs, which its next replay overwrites."""
    fields = [field.name for field in attrs.fields(DraftTree) if isinstance(getattr(tree, field.name), Tensor)]
    present = [value is not None for value in scores]
    inputs = [getattr(tree, field) for field in fields] + [value for value in scores if value is not None]
    key: Hashable = (name, tuple(fields), tuple(present), tuple((tuple(t.shape), t.dtype) for t in inputs), tree.height, tree.sampled, tree.sizes)

    def run(*static: Tensor) -> Sequence[Tensor]:
        columns, rest = static[: len(fields)], iter(static[len(fields):])
        return program(attrs.evolve(tree, **dict(zip(fields, columns))), Scores(*(next(rest) if kept else None for kept in present)))

    return graphs.run(key, run, inputs)


def replays(model: object, method: str = "replay") -> bool:
    """Whether ``model`` (a target, a drafter) steps as CUDA graphs and replays a program
    around its step forwards as one graph (its ``replay``; a batch's: ``replay_batch``)."""
    return getattr(model, "step_mode", "eager") == "graphs" and hasattr(model, method)


def fixed_growth(shape: tuple[int, int, int, bool], sampling: Sampling) -> bool:
    """Whether the core's growth of a tree of ``shape`` (:func:`~specimg.tree.dynamic_shape`)
    is a fixed program a graph can replay: its drafts are top-k (nothing drawn) and
    guidance never stops (no token index to track)."""
    return not shape[3] and sampling.cfg_interval < 0


class ReplayingDrafter(Drafter, Protocol):
    """A drafter that replays a program of its steps as one graph (``TreeDrafter.replay``)."""

    def replay(self, key: Hashable, program: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor]) -> Sequence[Tensor]: ...


def grow_replayed(
    drafter: ReplayingDrafter, sampling: Sampling, root_logits: Tensor, root_token: Tensor, shape: tuple[int, int, int, bool]
) -> DraftTree:
    """The core's EAGLE-2 growth of a top-k tree (``shape``: depth, top-k, nodes, as
    :func:`~specimg.tree.dynamic_shape` gives it; not sampled) from the drafter's root
    logits and the root's token [1], replayed as one graph per shape: every level's
    drafter forward, top-k and frontier, and the tree's assembly, in one launch.  Its
    columns are copied out of the graph's buffers: the step keeps its tree."""
    depth, topk, nodes, _ = shape
    assert fixed_growth(shape, sampling), "a replayed growth draws nothing and tracks no guidance interval"

    def grow(root_logits: Tensor, root_token: Tensor) -> list[Tensor]:
        session = DraftSession(drafter, sampling, root_logits, root_index=0, filtered=False)  # the index matters only where guidance stops
        return _grown_columns(build_dynamic(session, root_token, depth, topk, nodes))

    return _copied_tree(drafter.replay(("grow", shape, tuple(root_logits.shape)), grow, [root_logits, root_token]), height=depth)


def _grown_columns(tree: DraftTree) -> list[Tensor]:
    """A grown tree's columns as a replayed growth's outputs, in three tensors so that they
    come out of the graph in three copies rather than one a column: the integer columns
    (tokens, parents, depths, child ids and, for a forest, each node's image) flat in one,
    then the mask and the log-probs."""
    integers = [tree.tokens, tree.parents, tree.depths, *([] if tree.images is None else [tree.images]), tree.child_ids.flatten()]
    return [torch.cat(integers), tree.mask, tree.logprobs]


def _copied_tree(outputs: Sequence[Tensor], height: int, trees: int = 0) -> DraftTree:
    """The tree (a forest of ``trees`` trees of one size) whose columns a replayed growth
    left in ``outputs`` (:func:`_grown_columns`), copied out of the graph's buffers: the
    step keeps its tree."""
    integers, mask, logprobs = (t.clone() for t in outputs)
    n, node_columns = mask.shape[0], 4 if trees else 3
    tokens, parents, depths, *images, child_ids = integers.split([n] * node_columns + [integers.numel() - n * node_columns])
    return DraftTree(tokens, parents, depths, mask, logprobs, child_ids.view(n, -1), height=height,
                     images=images[0] if images else None, sizes=(n // trees,) * trees if trees else ())


class ReplayingBatch(Protocol):
    """A batch's draft state that feeds every image at once (``DraftBatch.expand_all``) and
    replays a program of its calls as one graph (``DraftBatch.replay``)."""

    step_mode: StepMode
    size: int

    def clear_nodes(self) -> None: ...

    def expand_all(self, parents: Tensor, tokens: Tensor) -> Tensor: ...

    def replay(self, key: Hashable, program: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor]) -> Sequence[Tensor]: ...


def grow_forest(batch: ReplayingBatch, sampling: Sampling, root_logits: Tensor, root_tokens: Tensor, shape: tuple[int, int, int, bool]) -> DraftTree:
    """:func:`grow_replayed` for every place of a batch, each growing a tree of ``shape``
    from its root logits [rows, B, V] and root token [B], from no nodes fed: one program
    for the batch's forest, every level's drafter forward one call for all the places.
    Replayed as one graph per shape where the batch steps as graphs; else run as it is
    (fixed shapes)."""
    depth, topk, nodes, _ = shape
    assert fixed_growth(shape, sampling), "a fixed growth draws nothing and tracks no guidance interval"
    batch.clear_nodes()

    def forest(root_logits: Tensor, root_tokens: Tensor) -> DraftTree:
        session = BatchSession(batch.expand_all, sampling, root_logits, root_tokens.new_zeros(root_tokens.shape), filtered=False)  # the index matters only where guidance stops
        return build_dynamic_batch(session, root_tokens, depth, topk, nodes)

    if batch.step_mode != "graphs":
        return forest(root_logits, root_tokens)

    def grow(root_logits: Tensor, root_tokens: Tensor) -> list[Tensor]:
        return _grown_columns(forest(root_logits, root_tokens))

    outputs = batch.replay(("grow", shape, tuple(root_logits.shape)), grow, [root_logits, root_tokens])
    return _copied_tree(outputs, depth, trees=root_tokens.shape[0])  # where a host read stalls every tree keeps its ``nodes`` best (none dropped): one size


class ReplayingTarget(Target, Protocol):
    """A target that replays a program around its step forward as one graph (``LlamaGenTarget.replay``)."""

    def replay(self, key: Hashable, program: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor]) -> Sequence[Tensor]: ...


def scores_replay(target: Target, sampling: Sampling) -> bool:
    """Whether the core's score of a top-k tree replays with its distributions
    (:func:`score_replayed`): the target replays programs and guidance never stops (no
    token index to track)."""
    return replays(target) and sampling.cfg_interval < 0


def score_replayed(target: ReplayingTarget, sampling: Sampling, tree: DraftTree) -> Scores:
    """The core's scores of a tree (the target's forward, then guidance, filter and softmax),
    replayed as one graph per tree size (where :func:`scores_replay`).  The scores are
    copied out of the graph's buffers: the step keeps them."""
    assert scores_replay(target, sampling), "a replayed score needs a replaying target and tracks no guidance interval"

    def score(tokens: Tensor, depths: Tensor, mask: Tensor) -> list[Tensor]:
        logits, hidden, layers = target.forward_tree(tokens, depths, mask)
        return [probabilities(logits, sampling), hidden, logits, *([] if layers is None else [layers])]

    probs, hidden, logits, *layers = (t.clone() for t in target.replay(("score", tree.size), score, [tree.tokens, tree.depths, tree.mask]))
    return Scores(probs, hidden, logits, *layers)


class ReplayingBatchTarget(BatchTrees, Protocol):
    """A batch target that replays a program around its trees' forward as one graph (``LlamaGenTarget.replay_batch``)."""

    def replay_batch(self, key: Hashable, nodes: int, program: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor]) -> Sequence[Tensor]: ...


def batch_scores_replay(target: Target, sampling: Sampling) -> bool:
    """Whether the core's scores of a batch's trees replay with their distributions
    (:func:`batch_scores_replayed`): :func:`scores_replay`, for a batch."""
    return replays(target, "replay_batch") and sampling.cfg_interval < 0


def batch_scores_replayed(target: ReplayingBatchTarget, sampling: Sampling, stacked: tuple[Tensor, Tensor, Tensor], nodes: Tensor) -> Scores:
    """The core's scores of the ``nodes`` [N] (flat ids, image i's node j at i * n + j) of
    a batch's trees (``stacked``: tokens, depths [B, n] and masks [B, n, n], as
    :func:`~specimg.tree.stack_trees` gives them): the target's forward, the nodes picked,
    then guidance, filter and softmax, replayed as one graph per tree size and node count
    (where :func:`batch_scores_replay`).  The scores are copied out of the graph's buffers."""
    assert batch_scores_replay(target, sampling), "a replayed score needs a replaying target and tracks no guidance interval"

    def score(tokens: Tensor, depths: Tensor, mask: Tensor, nodes: Tensor) -> list[Tensor]:
        logits, hidden, *layers = (t.flatten(1, 2)[:, nodes] for t in target.forward_trees(tokens, depths, mask) if t is not None)
        return [probabilities(logits, sampling), hidden, logits, *layers]

    key = ("scores", tuple(stacked[0].shape), nodes.shape[0])
    probs, hidden, logits, *layers = (t.clone() for t in target.replay_batch(key, stacked[0].shape[1], score, [*stacked, nodes]))
    return Scores(probs, hidden, logits, *layers)


def batch_ar_step_replayed(target: ReplayingBatchTarget, sampling: Sampling, last: Tensor, cfg_active: bool) -> Tensor:
    """A batch's AR step, every image's last token [B] verified as a one-node tree and the
    distributions [B, V] made from its logits, replayed as one graph per guidance state.
    The caller commits the roots.  The distributions are the graph's own output, which its
    next replay overwrites: the batch draws from them first."""

    def step(last: Tensor) -> list[Tensor]:
        root = torch.zeros_like(last)[:, None]  # depth 0, seeing itself
        logits = target.forward_trees(last[:, None], root, torch.ones(*root.shape, 1, dtype=torch.bool, device=last.device)).logits
        return [probabilities(logits[:, :, 0], sampling, cfg_active)]

    return target.replay_batch(("ar", cfg_active), 1, step, [last])[0]


def ar_step_replayed(target: ReplayingTarget, sampling: Sampling, last: Tensor, cfg_active: bool) -> Tensor:
    """AR's step, the forward of the last token [1] and its distribution [V], replayed as
    one graph per guidance state.  The distribution is the graph's own output, which its
    next replay overwrites: AR draws from it first."""

    def step(last: Tensor) -> list[Tensor]:
        root = torch.zeros_like(last)  # depth 0, seeing itself
        logits = target.forward_tree(last, root, torch.ones(1, 1, dtype=torch.bool, device=last.device)).logits
        return [probabilities(logits, sampling, cfg_active)[0]]

    return target.replay(("ar", cfg_active), step, [last])[0]
