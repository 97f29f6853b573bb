"""Draft trees and the builders that grow them from a drafter.

A tree's node 0 is the root: the last committed token, which the target has not consumed
yet.  Every other node is a drafted token whose parent has a smaller index.  A node at
depth d sits at position ``committed + d`` and attends to its ancestors and itself.

Trees grow one level at a time as tensors on the drafter's device: one drafter call and
one top-k per level, whatever the number of nodes, and no host round trip per node.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence

from specimg import stalls
from specimg.config import Sampling, TreeConfig
from specimg.errors import SpecimgError
from specimg.sampling import cfg_active_at, probabilities

if TYPE_CHECKING:
    from specimg.models.base import Drafter
    from specimg.models.eagle import DraftBatch


@attrs.frozen(eq=False)
class DraftTree:
    """A proposal: per node its token, parent (-1 at the root), depth, the ancestor mask
    [n, n], the drafter's log-prob of the token under its parent's draft distribution
    (0 at the root), each node's children padded with -1 as ``child_ids`` [n, C] (in
    draft-rank order), ``height`` (the deepest depth, or a bound on it), and for sampled trees the draft distribution each node's children
    were drawn from ([n, V], zero rows for nodes without children).

    A forest (:meth:`forest`) holds several images' trees as one, tree after tree: every
    tree's root has parent -1, ``images`` [n] names the tree each node belongs to (None:
    one tree) and ``sizes`` holds each tree's node count."""

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    mask: Tensor
    logprobs: Tensor
    child_ids: Tensor
    height: int
    draft_probs: Tensor | None = None
    sampled: bool = False
    images: Tensor | None = None
    sizes: tuple[int, ...] = ()

    @classmethod
    def from_parents(
        cls,
        tokens: Sequence[int],
        parents: Sequence[int],
        logprobs: Sequence[float] | None = None,
        draft_probs: Tensor | None = None,
        sampled: bool = False,
    ) -> DraftTree:
        """A tree from Python lists, validated (tests, hand-made trees)."""
        n = len(tokens)
        if len(parents) != n or n == 0 or parents[0] != -1:
            raise ValueError("a tree needs one parent per node and node 0 as its root")
        depths = [0] * n
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise ValueError(f"node {i} has parent {parents[i]}; parents must precede their children")
            depths[i] = depths[parents[i]] + 1
        return cls.from_tensors(
            torch.as_tensor(tokens, dtype=torch.long),
            torch.as_tensor(parents, dtype=torch.long),
            torch.tensor(depths, dtype=torch.long),
            torch.as_tensor(logprobs if logprobs is not None else [0.0] * n, dtype=torch.float32),
            draft_probs=draft_probs,
            sampled=sampled,
        )

    @classmethod
    def from_tensors(
        cls,
        tokens: Tensor,
        parents: Tensor,
        depths: Tensor,
        logprobs: Tensor,
        draft_probs: Tensor | None = None,
        sampled: bool = False,
        width: int | None = None,
        height: int | None = None,
        images: Tensor | None = None,
        sizes: Sequence[int] = (),
    ) -> DraftTree:
        """A tree, or a forest (with ``images`` and ``sizes``), from node tensors whose
        parents precede their children (unchecked: the builders guarantee it).  ``width``
        (most children of a node) and ``height`` (deepest depth) save a host round trip
        each when the caller knows a bound."""
        n, device = tokens.shape[0], tokens.device
        if height is None:
            height = int(depths.max())
        eye = torch.eye(n, dtype=torch.bool, device=device)
        up = torch.where(parents >= 0, parents, torch.arange(n, device=device))  # a root is its own parent here
        mask = eye
        for _ in range(height):  # after k rounds a row holds oneself and the ancestors up to k levels above
            mask = eye | mask[up]
        slot = torch.where(parents >= 0, parents, n)  # roots count as the children of a spare slot n
        counts = torch.zeros(n + 1, dtype=torch.long, device=device).index_add_(0, slot, torch.ones_like(slot))  # not bincount: it reads the host on CUDA
        if width is None:
            width = int(counts[:n].max())
        columns = max(1, width)
        order = torch.sort(slot, stable=True)  # children of a node stay in id (= draft-rank) order
        rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[order.values]
        child_ids = torch.full((n + 1, columns), -1, dtype=torch.long, device=device)
        child_ids[order.values, rank.clamp(max=columns - 1)] = order.indices  # the spare slot's row is dropped
        return cls(tokens, parents, depths, mask, logprobs, child_ids[:n], height, draft_probs, sampled, images, tuple(sizes))

    @classmethod
    def forest(cls, trees: Sequence[DraftTree]) -> DraftTree:
        """Several images' trees as one, tree after tree: what a method that takes a batch
        relaxes in one call.  Node ids run on from one tree to the next, so a rule that
        acts per node (on its children, its distribution) reads a forest as it reads a
        tree; a rule that compares nodes must keep to one tree (``images``).  It is sampled
        where its trees are (a one-node tree, which drew nothing, joins either kind)."""
        sizes = [t.size for t in trees]
        device, total = trees[0].tokens.device, sum(sizes)
        counts = stalls.on_device(sizes, device)
        images = torch.repeat_interleave(torch.arange(len(trees), device=device), counts, output_size=total)
        offset = torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)  # each node's tree's first id
        parents = torch.cat([t.parents for t in trees])
        width = max(t.child_ids.shape[1] for t in trees)
        child_ids = torch.cat([F.pad(t.child_ids, (0, width - t.child_ids.shape[1]), value=-1) for t in trees])
        draft_probs = None
        if any(t.draft_probs is not None for t in trees):
            vocab = next(t.draft_probs for t in trees if t.draft_probs is not None).shape[-1]
            draft_probs = torch.cat([t.draft_probs if t.draft_probs is not None else torch.zeros(t.size, vocab, device=device) for t in trees])
        return cls(
            tokens=torch.cat([t.tokens for t in trees]),
            parents=torch.where(parents >= 0, parents + offset, -1),
            depths=torch.cat([t.depths for t in trees]),
            mask=torch.block_diag(*(t.mask for t in trees)),
            logprobs=torch.cat([t.logprobs for t in trees]),
            child_ids=torch.where(child_ids >= 0, child_ids + offset[:, None], -1),
            height=max(t.height for t in trees),
            draft_probs=draft_probs,
            sampled=any(t.sampled for t in trees) and all(t.sampled or t.size == 1 for t in trees),  # a one-node tree drew nothing
            images=images,
            sizes=tuple(sizes),
        )

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Where a forest's trees lie: (start, stop) per tree."""
        ends = list(itertools.accumulate(self.sizes))
        return list(zip([0, *ends[:-1]], ends))

    def trees(self) -> list[DraftTree]:
        """A forest's trees, each in its own node ids (views of the forest's nodes, one
        split per column; each keeps the forest's ``height``, a bound on its own)."""
        assert self.images is not None, "not a forest"
        sizes, spans = list(self.sizes), self.spans
        offset = self._tree_starts()
        parents = (self.parents - offset).clamp_(min=-1)  # a node's ids are its tree's (at least its start); -1 stays -1
        child_ids = (self.child_ids - offset[:, None]).clamp_(min=-1)
        columns = (self.tokens, parents, self.depths, self.mask, self.logprobs, child_ids)
        draft_probs = [None] * len(sizes) if self.draft_probs is None else self.draft_probs.split_with_sizes(sizes)
        return [
            DraftTree(tokens, parents, depths, mask[:, a:b], logprobs, child_ids, self.height, probs, self.sampled)
            for (a, b), tokens, parents, depths, mask, logprobs, child_ids, probs in zip(spans, *[c.split_with_sizes(sizes) for c in columns], draft_probs)
        ]

    def _tree_starts(self) -> Tensor:
        """A forest's node ids of each node's tree's first node [n]: each tree's least node
        id, found on the device (no host data, so a CUDA graph can replay it), or from the
        size where every tree has one."""
        assert self.images is not None
        if len(set(self.sizes)) == 1:  # trees of one size (grown at one shape): tree i starts at i * size
            return self.images * self.sizes[0]
        nodes = torch.arange(self.size, device=self.tokens.device)
        first = nodes.new_full((len(self.sizes),), self.size).scatter_reduce_(0, self.images, nodes, "amin")
        return first[self.images]

    def places(self) -> tuple[Tensor, Tensor, Tensor]:
        """The trees side by side, padded to the largest (K nodes): each node's tree and
        place in it ([n] each), and the node at each place ([trees, K], -1 past a tree's
        end).  For rules that compare a node with the rest of its own tree."""
        n, device = self.size, self.tokens.device
        nodes = torch.arange(n, device=device)
        if self.images is None:
            return torch.zeros(n, dtype=torch.long, device=device), nodes, nodes[None]
        local = nodes - self._tree_starts()
        slot = torch.full((len(self.sizes), max(self.sizes)), -1, dtype=torch.long, device=device)
        return self.images, local, slot.index_put_((self.images, local), nodes)

    def stacked(self) -> tuple[Tensor, Tensor, Tensor]:
        """A forest as one batch input, as :func:`stack_trees` stacks its trees: views of its
        columns where every tree has one size (the diagonal blocks of its ancestor mask)."""
        assert self.images is not None, "not a forest"
        count, n = len(self.sizes), self.sizes[0]
        if len(set(self.sizes)) == 1:
            mask = self.mask.view(count, n, count, n).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [i, j, b] = mask[b, i, b, j]
            return self.tokens.view(count, n), self.depths.view(count, n), mask
        return stack_trees(self.trees())

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children in draft-rank order (a host copy: for reading, not hot loops)."""
        return tuple(tuple(c for c in row if c >= 0) for row in self.child_ids.tolist())

    def candidates(self) -> tuple[Tensor, Tensor]:
        """Children per node as a padded matrix: tokens [n, C] and node ids [n, C], -1 where
        a node has fewer than C children; columns are in draft-rank order."""
        ids = self.child_ids
        return torch.where(ids >= 0, self.tokens[ids.clamp(min=0)], torch.full_like(ids, -1)), ids


def stack_trees(trees: Sequence[DraftTree]) -> tuple[Tensor, Tensor, Tensor]:
    """Several images' trees as one batch input: tokens and depths [B, n] and ancestor
    masks [B, n, n], n the largest tree's size; a smaller tree's padding nodes see only
    themselves (so no real node sees them, and none is ever accepted)."""
    n = max(t.size for t in trees)
    tokens = pad_sequence([t.tokens for t in trees], batch_first=True)
    depths = pad_sequence([t.depths for t in trees], batch_first=True)
    mask = torch.eye(n, dtype=torch.bool, device=tokens.device).repeat(len(trees), 1, 1)
    for rows, tree in zip(mask, trees):
        rows[: tree.size, : tree.size] = tree.mask
    return tokens, depths, mask


class BatchSession:
    """One step's drafting for G images of a batch at once, each drafting the same tree
    shape: the drafter's processed distributions for fed nodes, image by image along a
    leading axis.

    Node ids are the session's own, per image: 0 is the root, fed nodes count from 1 in
    feeding order.  ``expand(parents, tokens)`` ([G, f] session ids and tokens) is the
    drafter's call; it returns their logits [rows, G, f, V].  ``root_index`` [G]: the
    image token each image's root is (its first drafts predict the next).  The logits get
    the run's CFG and temperature; the top-k/top-p filters only when drafts are sampled
    (``filtered``), so that no draft is a token the target masks.  Ranking top-k drafts
    needs no filter, and skipping it saves a selection over V per node."""

    def __init__(self, expand: Callable[[Tensor, Tensor], Tensor], sampling: Sampling, root_logits: Tensor, root_index: Tensor, filtered: bool = True):
        self._expand = expand
        self.sampling = sampling if filtered else attrs.evolve(sampling, top_k=0, top_p=1.0)
        self.device = root_logits.device
        self._depths: Tensor | None = None  # each fed node's depth, where guidance stops at some token (else unused)
        if sampling.cfg_interval >= 0:
            self._first = root_index[:, None] + 1  # the image token each image's first drafts predict
            self._depths = torch.zeros(root_index.shape[0], 1, dtype=torch.long, device=self.device)
        self.root_probs = self._process(root_logits[:, :, None, :], self._depths)[:, 0]

    def _process(self, logits: Tensor, depths: Tensor | None) -> Tensor:
        active = True if depths is None else cfg_active_at(depths, self.sampling, self._first)
        return probabilities(logits, self.sampling, active)

    def feed(self, parents: Tensor, tokens: Tensor) -> Tensor:
        """Feed nodes [G, f] (children of fed session nodes ``parents``) and return their
        draft distributions [G, f, V]; they get the next session ids in order."""
        depths = None
        if self._depths is not None:
            depths = self._depths.gather(1, parents) + 1
            self._depths = torch.cat([self._depths, depths], dim=1)
        return self._process(self._expand(parents, tokens).to(self.device), depths)


class DraftSession:
    """One step's drafting for one image: the drafter's processed distributions for fed
    nodes (node ids as :class:`BatchSession`'s), ``root_probs`` [V] those of the root's
    children.  ``batch`` is the same session as a batch of one, in which the builders grow
    one image's tree as they grow a batch's."""

    def __init__(self, drafter: Drafter, sampling: Sampling, root_logits: Tensor, root_index: int, filtered: bool = True):
        self.drafter, self.root_index, self.device = drafter, root_index, root_logits.device
        self.batch = BatchSession(lambda parents, tokens: drafter.expand(parents[0], tokens[0])[:, None], sampling, root_logits[:, None],
                                  torch.full((1,), root_index, device=self.device), filtered)
        self.sampling = self.batch.sampling
        self.root_probs = self.batch.root_probs[0]

    def feed(self, parents: Tensor | Sequence[int], tokens: Tensor | Sequence[int]) -> Tensor:
        """Feed nodes (children of fed session nodes ``parents``) and return their draft
        distributions [f, V]; they get the next session ids in order."""
        parents = torch.as_tensor(parents, dtype=torch.long, device=self.device)
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        return self.batch.feed(parents[None], tokens[None])[0]


def pick_children(probs: Tensor, count: int, sample: bool, generators: Sequence[torch.Generator | None] | None) -> tuple[Tensor, Tensor]:
    """Per row of G images' ``probs`` [G, f, V]: the drafter's top-``count`` tokens, or
    ``count`` tokens drawn without replacement from image g's ``generators[g]`` (None:
    torch's default generator; Gumbel-top-k keeps the draw order), and their log-probs
    [G, f, count]; a pick of probability 0 has log-prob -inf and must not be kept."""
    logq = probs.log()
    keys = logq
    if sample:
        assert generators is not None
        uniform = torch.stack([torch.rand(row.shape, generator=g, device=probs.device) for row, g in zip(probs, generators)]).clamp_(min=1e-20)
        keys = logq - (-uniform.log()).log()
    top = torch.topk(keys, min(count, probs.shape[-1]), dim=-1).indices
    return top, logq.gather(-1, top)


class _Growth:
    """G images' trees under construction, all of one shape: node columns [G, nodes]
    appended level by level, the map from tree node to the session node that fed it, and
    the draft distributions of fed nodes."""

    def __init__(self, session: BatchSession, root_tokens: Tensor, capacity: int):
        count, device = root_tokens.shape[0], session.device
        self.session, self.device = session, device
        self.levels: list[tuple[Tensor, Tensor, Tensor, Tensor]] = [
            (root_tokens[:, None], torch.full((count, 1), -1, device=device), torch.zeros(count, 1, device=device), torch.zeros(count, 1, device=device))
        ]  # (tokens, parents, logq, score) [G, nodes] per level
        self.session_of = torch.full((count, capacity), -1, dtype=torch.long, device=device)
        self.session_of[:, 0].fill_(0)
        self.fed: list[tuple[Tensor, Tensor]] = [(torch.zeros(count, 1, dtype=torch.long, device=device), session.root_probs[:, None])]
        self.size, self.fed_count, self.width = 1, 0, 0
        self._columns: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None

    def add(self, parents: Tensor, tokens: Tensor, logq: Tensor, scores: Tensor) -> Tensor:
        """Append one level: ``parents`` [G, f] with ``tokens``, ``logq``, ``scores`` [G, f, k]
        (children in draft-rank order); returns the new node ids [f * k], every image's."""
        f, k = tokens.shape[1:]
        self.levels.append((tokens.flatten(1), parents[..., None].expand(-1, f, k).flatten(1), logq.flatten(1), scores.flatten(1)))
        self.size, self.width = self.size + f * k, max(self.width, k)
        return torch.arange(self.size - f * k, self.size, device=self.device)

    def feed(self, nodes: Tensor, parents: Tensor, tokens: Tensor) -> Tensor:
        """Feed tree nodes ``nodes`` [G, f] (children of fed ``parents``, with ``tokens``) to
        the drafter; their draft distributions [G, f, V]."""
        count, f = nodes.shape
        self.session_of.scatter_(1, nodes, torch.arange(self.fed_count + 1, self.fed_count + 1 + f, device=self.device).expand(count, -1))
        probs = self.session.feed(self.session_of.gather(1, parents), tokens)
        self.fed_count += f
        self.fed.append((nodes, probs))
        return probs

    def columns(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """tokens, parents, logq, scores and depths [G, size] of every node so far (joined once per level)."""
        if self._columns is None or self._columns[0].shape[1] != self.size:
            tokens, parents, logq, scores = [torch.cat(c, dim=1) for c in zip(*self.levels)]
            depths = torch.cat([torch.full_like(part[1], level) for level, part in enumerate(self.levels)], dim=1)
            self._columns = (tokens, parents, logq, scores, depths)
        return self._columns

    def forest(self, keep: Tensor, sizes: Sequence[int], sampled: bool) -> DraftTree:
        """The forest of every image's subtree of the nodes ``keep`` [G, size] (closed under
        ancestors; image g keeps ``sizes[g]``), with the draft distributions of the fed nodes
        for sampled trees: one pass for all the images, no host read."""
        tokens, parents, logq, _, depths = self.columns()
        count, size = tokens.shape
        flat = keep.flatten()
        nodes = torch.sort((~flat).byte(), stable=True).indices[: sum(sizes)]  # the kept grown ids, image after image
        new_id = flat.cumsum(0) - 1  # each kept grown node's forest id
        image = nodes // size
        grown_parents = parents.flatten()[nodes]
        forest_parents = torch.where(grown_parents >= 0, new_id[image * size + grown_parents], -1)  # a root's -1 reads a wrong id, unused
        draft_probs = None
        if sampled:
            fed_nodes, probs = (torch.cat(c, dim=1) for c in zip(*self.fed))  # [G, F], [G, F, V]
            at = fed_nodes + torch.arange(count, device=self.device)[:, None] * size
            rows = torch.where(flat[at], new_id[at], len(nodes)).flatten()  # a fed node that was not kept goes to a spare row
            draft_probs = torch.zeros(len(nodes) + 1, probs.shape[-1], device=self.device).index_copy_(0, rows, probs.flatten(0, 1))[:-1]
        return DraftTree.from_tensors(
            tokens.flatten()[nodes], forest_parents, depths.flatten()[nodes], logq.flatten()[nodes], draft_probs, sampled,
            width=self.width, height=len(self.levels) - 1, images=image, sizes=sizes,
        )


def build_dynamic(
    session: DraftSession,
    root_token: int | Tensor,
    depth: int,
    topk: int,
    total_tokens: int,
    sample: bool = False,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """EAGLE-2's dynamic tree of one image (:func:`build_dynamic_batch`), from its root's
    token (or that token [1] on the device)."""
    root = root_token if isinstance(root_token, Tensor) else torch.full((1,), root_token, device=session.device)
    forest = build_dynamic_batch(session.batch, root, depth, topk, total_tokens, sample, [generator])
    return attrs.evolve(forest, images=None, sizes=())  # the one tree of a forest of one


def build_dynamic_batch(
    session: BatchSession, root_tokens: Tensor, depth: int, topk: int, total_tokens: int, sample: bool = False,
    generators: Sequence[torch.Generator | None] | None = None,
) -> DraftTree:
    """EAGLE-2's dynamic trees of G images (``root_tokens`` [G]), as one forest: per depth,
    expand each image's ``topk`` best frontier nodes by cumulative draft log-prob into
    ``topk`` children each, one drafter call and one top-k per level for all the images.

    Top-k drafts then keep each image's ``total_tokens`` best nodes (a set closed under
    ancestors, since a child never scores above its parent).  Sampled drafts (image g's
    from ``generators[g]``) keep every drawn child (recursive rejection needs each node's
    full draw) and spend the budget by expanding fewer nodes.  On a device where a host
    read stalls, drafts of probability 0 (all sorted last, parents before children) stay
    in the tree rather than be counted."""
    count = root_tokens.shape[0]
    topk = min(topk, session.root_probs.shape[-1])
    grow = _Growth(session, root_tokens, capacity=1 + depth * topk * topk)
    frontier = torch.zeros(count, 1, dtype=torch.long, device=session.device)
    frontier_scores = torch.zeros(count, 1, device=session.device)
    probs, budget = session.root_probs[:, None], total_tokens - 1
    for level in range(1, depth + 1):
        if sample:
            keep = min(frontier.shape[1], max(0, budget // topk))
            frontier, frontier_scores, probs = frontier[:, :keep], frontier_scores[:, :keep], probs[:, :keep]
        if frontier.shape[1] == 0:
            break
        tokens, logq = pick_children(probs, topk, sample, generators)
        scores = frontier_scores[..., None] + logq
        ids = grow.add(frontier, tokens, logq, scores)
        budget -= ids.shape[0]
        if level == depth:
            break
        best = torch.sort(scores.flatten(1), dim=1, descending=True, stable=True).indices[:, :topk]  # ties: lower id first
        frontier, frontier_scores = ids[best], scores.flatten(1).gather(1, best)
        probs = grow.feed(frontier, grow.levels[-1][1].gather(1, best), tokens.flatten(1).gather(1, best))
    return grow.forest(*_best_kept(grow.columns()[3], total_tokens, sample), sample)


def _best_kept(scores: Tensor, total_tokens: int, sample: bool) -> tuple[Tensor, list[int]]:
    """Which grown nodes (scores [G, size]) each image keeps, and how many: every drawn pick
    of a sampled tree, else the ``total_tokens`` best (the root first: it scores 0, the
    most, with the lowest id); a host read only where it is free (the CPU: drafts of
    probability 0 dropped) or needed (sampled trees' sizes)."""
    count, size = scores.shape
    if sample:
        keep = scores > -torch.inf  # drop picks of probability 0
        return keep, keep.sum(dim=1).tolist()
    best = torch.sort(scores, dim=1, descending=True, stable=True)  # ties: lower id first
    if stalls.host_reads_stall(scores.device):
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best.indices[:, :total_tokens], True), [min(total_tokens, size)] * count
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best.indices[:, :total_tokens], best.values[:, :total_tokens] > -torch.inf)
    return keep, keep.sum(dim=1).tolist()  # drafts of probability 0 dropped, where counting them is free


def build_static(
    session: DraftSession,
    root_token: int,
    rank_paths: Sequence[Sequence[int]],
    sample: bool = False,
    generator: torch.Generator | None = None,
    max_depth: int | None = None,
) -> DraftTree:
    """A fixed tree: each path (r1, ..., rd) is the node reached by taking the drafter's
    r1-th choice at the root, then its r2-th choice, and so on (Medusa/LANTERN++ trees).
    One drafter call per level feeds every node that has children."""
    limit = max_depth if max_depth is not None else max((len(p) for p in rank_paths), default=0)
    paths = sorted({tuple(p) for p in rank_paths if 0 < len(p) <= limit}, key=lambda p: (len(p), p))
    known = set(paths) | {()}
    for path in paths:
        if path[:-1] not in known or (path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in known):
            raise SpecimgError(f"static tree path {path} lacks its parent or its previous sibling")
    device = session.device
    levels = [sorted({p[:-1] for p in paths if len(p) == level}) for level in range(1, max((len(p) for p in paths), default=0) + 1)]
    widths = [1 + max(p[-1] for p in paths if len(p) == level) for level in range(1, len(levels) + 1)]
    grow = _Growth(session.batch, torch.full((1,), root_token, device=device), capacity=1 + sum(len(ps) * w for ps, w in zip(levels, widths)))
    node_of: dict[tuple[int, ...], int] = {(): 0}
    probs = session.batch.root_probs[:, None]
    for level, (prefixes, width) in enumerate(zip(levels, widths), start=1):
        prefixes = [p for p in prefixes if p in node_of]  # not below ranks the vocabulary lacks
        if not prefixes:
            break
        nodes = torch.tensor([[node_of[p] for p in prefixes]], device=device)
        tokens, _, logq, _, _ = grow.columns()
        if level > 1:  # feed this level's parents, one drafter call
            parents = torch.tensor([[node_of[p[:-1]] for p in prefixes]], device=device)
            probs = grow.feed(nodes, parents, tokens.gather(1, nodes))
        picked, pick_logq = pick_children(probs, width, sample, [generator])
        pick_logq = torch.where(logq.gather(1, nodes)[..., None] > -torch.inf, pick_logq, -torch.inf)  # below a dropped pick
        base, picks = grow.size, picked.shape[2]  # fewer than width when the vocabulary is smaller
        grow.add(nodes, picked, pick_logq, pick_logq)
        for row, prefix in enumerate(prefixes):
            for rank in range(picks):
                if prefix + (rank,) in known:
                    node_of[prefix + (rank,)] = base + row * picks + rank
    wanted = torch.zeros(1, grow.size, dtype=torch.bool, device=device)
    wanted[0, sorted(node_of.values())] = True
    keep = wanted & (grow.columns()[2] > -torch.inf)  # not a pick of probability 0, nor anything below it
    return attrs.evolve(grow.forest(keep, keep.sum(dim=1).tolist(), sample), images=None, sizes=())


def build_tree(
    session: DraftSession, root_token: int, config: TreeConfig, max_depth: int, generator: torch.Generator | None = None
) -> DraftTree:
    """The tree ``config`` asks for, no deeper than ``max_depth`` (the tokens still missing)."""
    depth = min(config.depth, max_depth)
    if depth == 0:  # the root alone
        return build_dynamic(session, root_token, 0, 1, 1)
    if config.kind == "static":
        return build_static(session, root_token, config.rank_paths, config.sample, generator, max_depth=depth)
    if config.kind == "auto":
        raise SpecimgError("an auto tree is resolved by the engine's planner; build_tree takes a concrete shape")
    shape = dynamic_shape(config, max_depth)
    assert shape is not None
    return build_dynamic(session, root_token, *shape, generator)


def dynamic_shape(config: TreeConfig, max_depth: int) -> tuple[int, int, int, bool] | None:
    """The EAGLE-2 tree a dynamic or chain ``config`` grows no deeper than ``max_depth``:
    (depth, top-k, nodes, sampled); None for another kind."""
    depth = min(config.depth, max_depth)
    if config.kind == "chain":
        return depth, 1, depth + 1, config.sample
    if config.kind == "dynamic":
        return depth, config.topk, config.total_tokens, config.sample
    return None


def fixed_growth(shape: tuple[int, int, int, bool], sampling: Sampling) -> bool:
    """Whether the core's growth of a tree of ``shape`` (:func:`dynamic_shape`) is a fixed
    program: its drafts are top-k (nothing drawn) and guidance never stops (no token
    index to track)."""
    return not shape[3] and sampling.cfg_interval < 0


def grow_forest(
    batch: DraftBatch, sampling: Sampling, roots: Mapping[int, tuple[Tensor, int]], shape: tuple[int, int, int, bool]
) -> DraftTree:
    """The core's EAGLE-2 growth for every place of a batch, each growing a top-k tree of
    ``shape`` (:func:`fixed_growth`) from no nodes fed: the places in ``roots`` from their
    root logits [rows, V] and root token; any other place (its image finished, sent to
    AR, or drafting another shape) a scratch tree from a uniform root, never used.  Every
    level's drafter forward is one call for all the places (``expand_all``, a fixed-shape
    program), so that each level runs at one shape whichever images draft."""
    depth, topk, nodes, _ = shape
    assert fixed_growth(shape, sampling), "a fixed growth draws nothing and tracks no guidance interval"
    scratch = torch.zeros_like(next(iter(roots.values()))[0]) if len(roots) < batch.size else None  # one uniform root for every other place
    root_logits = torch.stack([roots[place][0] if place in roots else scratch for place in range(batch.size)], dim=1)
    tokens = stalls.on_device([roots[place][1] if place in roots else 0 for place in range(batch.size)], root_logits.device)
    batch.clear_nodes()
    session = BatchSession(batch.expand_all, sampling, root_logits, tokens.new_zeros(tokens.shape), filtered=False)  # the index matters only where guidance stops
    return build_dynamic_batch(session, tokens, depth, topk, nodes)
