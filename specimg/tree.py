"""Draft trees and the builders that grow them from a drafter.

A tree's node 0 is the root: the last committed token, which the target has not consumed
yet.  Every other node is a drafted token whose parent has a smaller index.  A node at
depth d sits at position ``committed + d`` and attends to its ancestors and itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from specimg.config import Sampling, TreeConfig
from specimg.errors import SpecimgError
from specimg.models.base import Drafter
from specimg.sampling import cfg_active_at, probabilities


@attrs.frozen(eq=False)
class DraftTree:
    """A proposal: per node its token, parent (-1 at the root), depth, the ancestor mask
    [n, n], the drafter's log-prob of the token under its parent's draft distribution
    (0 at the root), each node's children (also padded with -1 as ``child_ids`` [n, C], in
    draft-rank order), and for sampled trees the draft distribution each node's children
    were drawn from ([n, V], zero rows for nodes without children)."""

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    mask: Tensor
    logprobs: Tensor
    children: tuple[tuple[int, ...], ...]
    child_ids: Tensor
    draft_probs: Tensor | None = None
    sampled: bool = False

    @classmethod
    def from_parents(
        cls,
        tokens: Sequence[int],
        parents: Sequence[int],
        logprobs: Sequence[float] | None = None,
        draft_probs: Tensor | None = None,
        sampled: bool = False,
    ) -> DraftTree:
        n = len(tokens)
        if len(parents) != n or n == 0 or parents[0] != -1:
            raise ValueError("a tree needs one parent per node and node 0 as its root")
        depths = [0] * n
        ancestors: list[list[int]] = [[0]]
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            parent = parents[i]
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must precede their children")
            depths[i] = depths[parent] + 1
            ancestors.append(ancestors[parent] + [i])
            children[parent].append(i)
        mask = torch.zeros(n, n, dtype=torch.bool)
        rows = torch.tensor([i for i, anc in enumerate(ancestors) for _ in anc])
        cols = torch.tensor([j for anc in ancestors for j in anc])
        mask[rows, cols] = True
        width = max(1, max(len(c) for c in children))
        return cls(
            tokens=torch.as_tensor(tokens, dtype=torch.long),
            parents=torch.as_tensor(parents, dtype=torch.long),
            depths=torch.tensor(depths, dtype=torch.long),
            mask=mask,
            logprobs=torch.as_tensor(logprobs if logprobs is not None else [0.0] * n, dtype=torch.float32),
            children=tuple(tuple(c) for c in children),
            child_ids=torch.tensor([c + [-1] * (width - len(c)) for c in children], dtype=torch.long),
            draft_probs=draft_probs,
            sampled=sampled,
        )

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root to ``node``, in order."""
        path = []
        parents = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def candidates(self) -> tuple[Tensor, Tensor]:
        """Children per node as a padded matrix: tokens [n, C] and node ids [n, C], -1 where
        a node has fewer than C children; columns are in draft-rank order."""
        ids = self.child_ids
        return torch.where(ids >= 0, self.tokens[ids.clamp(min=0)], torch.full_like(ids, -1)), ids


class DraftSession:
    """One step's drafting: the drafter's processed distributions for fed nodes.

    Node ids are the session's own: 0 is the root, fed nodes count from 1 in feeding order.
    The drafter's logits get the run's CFG and temperature; the top-k/top-p filters only
    when drafts are sampled (``filtered``), so that no draft is a token the target masks.
    Ranking top-k drafts needs no filter, and skipping it saves a selection over V per node.
    """

    def __init__(self, drafter: Drafter, sampling: Sampling, root_logits: Tensor, root_index: int, filtered: bool = True):
        self.drafter = drafter
        self.sampling = sampling if filtered else attrs.evolve(sampling, top_k=0, top_p=1.0)
        self.root_index = root_index
        self._depths = [0]
        self.root_probs = self._process(root_logits[:, None, :], [0])[0]

    def _process(self, logits: Tensor, depths: list[int]) -> Tensor:
        index = torch.tensor(depths, dtype=torch.long) + self.root_index + 1
        return probabilities(logits, self.sampling, cfg_active_at(index, self.sampling))

    def feed(self, parents: list[int], tokens: list[int]) -> Tensor:
        """Feed nodes (children of fed session nodes ``parents``) and return their draft
        distributions [f, V]; they get the next session ids in order."""
        depths = [self._depths[p] + 1 for p in parents]
        self._depths.extend(depths)
        logits = self.drafter.expand(torch.tensor(parents, dtype=torch.long), torch.tensor(tokens, dtype=torch.long))
        return self._process(logits, depths)


def _pick_children(probs: Tensor, count: int, sample: bool, generator: torch.Generator | None) -> list[tuple[list[int], list[float]]]:
    """Per row of ``probs`` [f, V]: the drafter's top-``count`` tokens, or ``count`` tokens
    drawn without replacement (Gumbel-top-k keeps the draw order), with their log-probs;
    tokens of probability 0 are never picked."""
    logq = probs.log()
    keys = logq
    if sample:
        uniform = torch.rand(probs.shape, generator=generator).clamp_(min=1e-20)
        keys = logq - (-uniform.log()).log()
    top = torch.topk(keys, min(count, probs.shape[-1]), dim=-1).indices
    picked = []
    for tokens, logqs in zip(top.tolist(), logq.gather(-1, top).tolist()):
        kept = [(t, lq) for t, lq in zip(tokens, logqs) if lq > -math.inf]
        picked.append(([t for t, _ in kept], [lq for _, lq in kept]))
    return picked


class _Growing:
    """A tree under construction, with the map from tree node to fed session node."""

    def __init__(self, root_token: int, root_probs: Tensor):
        self.tokens, self.parents, self.logprobs, self.scores = [root_token], [-1], [0.0], [0.0]
        self.depths = [0]
        self.session_id = {0: 0}
        self.probs = {0: root_probs}

    def add(self, parent: int, token: int, logprob: float, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.logprobs.append(logprob)
        self.scores.append(score)
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def feed(self, session: DraftSession, nodes: list[int]) -> None:
        if not nodes:
            return
        probs = session.feed([self.session_id[self.parents[n]] for n in nodes], [self.tokens[n] for n in nodes])
        for node, p in zip(nodes, probs):
            self.session_id[node] = len(self.session_id)
            self.probs[node] = p

    def tree(self, keep: list[int], sampled: bool) -> DraftTree:
        keep = sorted(keep)
        new_id = {old: new for new, old in enumerate(keep)}
        draft_probs = None
        if sampled:
            draft_probs = torch.zeros(len(keep), self.probs[0].numel())
            for old, new in new_id.items():
                if old in self.probs:
                    draft_probs[new] = self.probs[old]
        return DraftTree.from_parents(
            tokens=[self.tokens[i] for i in keep],
            parents=[new_id[self.parents[i]] if i else -1 for i in keep],
            logprobs=[self.logprobs[i] for i in keep],
            draft_probs=draft_probs,
            sampled=sampled,
        )


def build_dynamic(
    session: DraftSession,
    root_token: int,
    depth: int,
    topk: int,
    total_tokens: int,
    sample: bool = False,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """EAGLE-2's dynamic tree: per depth, expand the ``topk`` best frontier nodes by
    cumulative draft log-prob into ``topk`` children each.

    Top-k drafts then keep the ``total_tokens`` best nodes overall (a set closed under
    ancestors, since a child never scores above its parent).  Sampled drafts keep every
    drawn child (recursive rejection needs each node's full draw) and spend the budget by
    expanding fewer nodes.
    """
    grow = _Growing(root_token, session.root_probs)
    frontier = [0]
    budget = total_tokens - 1
    for level in range(1, depth + 1):
        if sample:
            frontier = frontier[: max(0, budget // topk)]
        new: list[int] = []
        picks = _pick_children(torch.stack([grow.probs[node] for node in frontier]), topk, sample, generator) if frontier else []
        for node, (tokens, logqs) in zip(frontier, picks):
            new += [grow.add(node, t, lq, grow.scores[node] + lq) for t, lq in zip(tokens, logqs)]
        budget -= len(new)
        if not new:
            break
        frontier = sorted(new, key=lambda i: (-grow.scores[i], i))[:topk]
        if level < depth:
            grow.feed(session, frontier)
    nodes = range(len(grow.tokens))
    if sample:
        return grow.tree(list(nodes), sampled=True)
    best = sorted(nodes[1:], key=lambda i: (-grow.scores[i], i))[: total_tokens - 1]
    return grow.tree([0, *best], sampled=False)


def build_static(
    session: DraftSession,
    root_token: int,
    rank_paths: Sequence[Sequence[int]],
    sample: bool = False,
    generator: torch.Generator | None = None,
    max_depth: int | None = None,
) -> DraftTree:
    """A fixed tree: each path (r1, ..., rd) is the node reached by taking the drafter's
    r1-th choice at the root, then its r2-th choice, and so on (Medusa/LANTERN++ trees)."""
    limit = max_depth if max_depth is not None else max((len(p) for p in rank_paths), default=0)
    paths = sorted({tuple(p) for p in rank_paths if 0 < len(p) <= limit}, key=lambda p: (len(p), p))
    known = set(paths) | {()}
    for path in paths:
        if path[:-1] not in known or (path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in known):
            raise SpecimgError(f"static tree path {path} lacks its parent or its previous sibling")
    grow = _Growing(root_token, session.root_probs)
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for level in range(1, max((len(p) for p in paths), default=0) + 1):
        level_paths = [p for p in paths if len(p) == level and p[:-1] in node_of]
        parents = sorted({node_of[p[:-1]] for p in level_paths})
        grow.feed(session, [n for n in parents if n not in grow.probs])
        for parent in parents:
            ranks = sorted(p[-1] for p in level_paths if node_of[p[:-1]] == parent)
            tokens, logqs = _pick_children(grow.probs[parent][None], ranks[-1] + 1, sample, generator)[0]
            path_prefix = next(p[:-1] for p in level_paths if node_of[p[:-1]] == parent)
            for rank in ranks:
                if rank < len(tokens):
                    node_of[path_prefix + (rank,)] = grow.add(parent, tokens[rank], logqs[rank], 0.0)
    return grow.tree(list(range(len(grow.tokens))), sampled=sample)


def build_tree(
    session: DraftSession, root_token: int, config: TreeConfig, max_depth: int, generator: torch.Generator | None = None
) -> DraftTree:
    """The tree ``config`` asks for, no deeper than ``max_depth`` (the tokens still missing)."""
    depth = min(config.depth, max_depth)
    if depth == 0:
        return DraftTree.from_parents([root_token], [-1])
    if config.kind == "static":
        return build_static(session, root_token, config.rank_paths, config.sample, generator, max_depth=depth)
    if config.kind == "chain":
        return build_dynamic(session, root_token, depth, 1, depth + 1, config.sample, generator)
    return build_dynamic(session, root_token, depth, config.topk, config.total_tokens, config.sample, generator)
