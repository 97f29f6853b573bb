"""A step's own device programs on a tree, replayed as CUDA graphs.

Between verify and accept a step runs tensor programs of its own: the relaxations alone
cost a GPU hundreds of launches a step, far more than the replayed forwards.  A program
that reads only a tree and the target's scores on it, with fixed shapes and no host read,
is captured once per tree shape (:class:`~specimg.graphs.GraphSet`) and then replays as
one launch plus the copies of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import attrs
from torch import Tensor

from specimg.graphs import GraphSet
from specimg.step import Scores
from specimg.tree import DraftTree

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
