"""Several images' drafting in one drafter forward per call.

A batch of images drafts their trees side by side (``Engine(batch_size=B)``); each image's
drafter calls are those it would make alone (``start`` with its newly committed tokens,
then ``expand`` level by level), but the calls of one kind are run together: one forward
of the draft layer over every image.  Images may bring different numbers of tokens or
nodes to a call and sit at different cache lengths, so each writes its own cache slots
and sees its own prefix and tree ancestors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from specimg.models.base import cfg_rows
from specimg.models.eagle import TreeDrafter

Request = tuple[Tensor, Tensor]
"""One image's call: (target features [rows, m, ...], tokens [m]) for ``start``, or
(parent node ids [f], tokens [f]) for ``expand``."""


class DraftBatch:
    """The draft state of ``size`` images over one drafter's weights: its caches hold image
    i's rows at r * size + i.  Images are known by index; an image not in a call's
    requests rides along on slots past its own nodes, which nothing reads."""

    def __init__(self, drafter: TreeDrafter, size: int, cfg: bool):
        if drafter.context:
            raise ValueError("a drafter that reads the whole condition drafts one image at a time")
        self.core = drafter.replica()
        self.size, self.rows = size, cfg_rows(cfg)
        c, w, n = drafter.layer_config, drafter.fc.weight, drafter.max_tree_nodes
        rows = self.rows * size
        self.capacity, self.max_nodes = drafter.capacity, n
        shape = (rows, c.kv_heads, self.capacity, c.head_dim)
        self.core._kv = [(w.new_zeros(shape), w.new_zeros(shape)) for _ in drafter.layers]
        self.feat = w.new_zeros(rows, 1 + n, c.dim)  # predicted state per node (0 = root)
        self.depth = torch.zeros(size, 1 + n, dtype=torch.long, device=w.device)
        self.anc = torch.zeros(size, 1 + n, 1 + n, dtype=torch.bool, device=w.device)  # ancestors-or-self by node id
        self.lengths = [0] * size  # committed pairs
        self.counts = [0] * size  # nodes fed since the last start
        self.device = w.device

    def reset(self, image: int) -> None:
        """Image ``image`` starts a new picture (its drafter's ``prefill``)."""
        self.lengths[image], self.counts[image] = 0, 0

    @torch.no_grad()
    def start(self, requests: Mapping[int, Request]) -> dict[int, Tensor]:
        """Each requesting image commits its m new pairs; their root logits [rows, V]."""
        core = self.core
        m = {i: int(tokens.shape[0]) for i, (_, tokens) in requests.items()}
        width = max(m.values())
        for i in requests:
            if self.lengths[i] + m[i] > self.capacity:
                raise ValueError(f"{m[i]} new pairs overflow the drafter cache ({self.capacity - self.lengths[i]} slots left)")
        states = self.feat.new_zeros(self.rows * self.size, width, self.feat.shape[-1])
        tokens = torch.zeros(self.size, width, dtype=torch.long, device=self.device)
        for i, (hidden, new) in requests.items():
            states[i :: self.size, : m[i]] = core._lift(hidden.to(self.device))
            tokens[i, : m[i]] = new.to(self.device)
        first = torch.tensor(self.lengths, device=self.device)[:, None]
        slots = first + torch.arange(width, device=self.device)  # pair j of image i at lengths[i] + j
        used = max(self.lengths) + width  # the slots any image uses: attention stops there
        seen = torch.arange(used, device=self.device) < slots[..., None] + 1  # its prefix and itself
        h = self._forward(states, tokens, slots, slots, seen)
        last = torch.tensor([m.get(i, 1) - 1 for i in range(self.size)], device=self.device).repeat(self.rows)
        ends = h[torch.arange(h.shape[0], device=self.device), last]
        self.feat[:, 0] = ends
        logits = core._logits(ends).float().view(self.rows, self.size, -1)
        for i in requests:
            self.lengths[i] += m[i]
            self.counts[i] = 0
        return {i: logits[:, i] for i in requests}

    @torch.no_grad()
    def expand(self, requests: Mapping[int, Request]) -> dict[int, Tensor]:
        """Each requesting image feeds f nodes (children of its nodes ``parents``: 0 = root,
        k = its k-th node fed since its start); their logits [rows, f, V]."""
        f = {i: int(tokens.shape[0]) for i, (_, tokens) in requests.items()}
        width = max(f.values())
        parents = torch.zeros(self.size, width, dtype=torch.long, device=self.device)
        tokens = torch.zeros(self.size, width, dtype=torch.long, device=self.device)
        new = torch.zeros(self.size, width, dtype=torch.long, device=self.device)  # node ids (padding: id 0, never read)
        for i, (mine, fed) in requests.items():
            c = self.counts[i]
            if c + f[i] > self.max_nodes:
                raise ValueError(f"{c + f[i]} draft nodes exceed max_tree_nodes={self.max_nodes}")
            ids = torch.arange(c + 1, c + f[i] + 1, device=self.device)
            mine = mine.to(self.device)
            self.depth[i, ids] = self.depth[i, mine] + 1
            self.anc[i, ids] = self.anc[i, mine]
            self.anc[i, ids, ids] = True
            parents[i, : f[i]], tokens[i, : f[i]], new[i, : f[i]] = mine, fed.to(self.device), ids
        images = torch.arange(self.size, device=self.device)[:, None]
        first = torch.tensor(self.lengths, device=self.device)[:, None]
        counts = torch.tensor(self.counts, device=self.device)[:, None]
        slots = (first + counts + torch.arange(width, device=self.device)).clamp_(max=self.capacity - 1)
        positions = self.depth[images, new] + first - 1  # the root sits at lengths[i] - 1
        used = min(self.capacity, max(n + c for n, c in zip(self.lengths, self.counts)) + width)  # attention stops there
        keys = torch.arange(used, device=self.device)
        seen = (keys < first)[:, None, :].expand(-1, width, -1).clone()  # the committed prefix ...
        node = keys - first + 1  # ... and the node at each later slot (id 0, never an ancestor, past them)
        node = torch.where(node <= self.max_nodes, node.clamp(min=0), 0)[:, None, :].expand(-1, width, -1)
        seen |= (keys >= first)[:, None, :] & self.anc[images, new].gather(2, node)
        states = self.feat.gather(1, parents.repeat(self.rows, 1)[..., None].expand(-1, -1, self.feat.shape[-1]))
        h = self._forward(states, tokens, slots, positions, seen)
        logits = self.core._logits(h).float().view(self.rows, self.size, width, -1)
        out = {}
        for i in requests:
            self.feat[i :: self.size, new[i, : f[i]]] = h[i :: self.size, : f[i]]
            self.counts[i] += f[i]
            out[i] = logits[:, i, : f[i]]
        return out

    def _forward(self, states: Tensor, tokens: Tensor, slots: Tensor, positions: Tensor, seen: Tensor) -> Tensor:
        """The draft layer over every image's pairs: states [rows * B, w, D], tokens, slots,
        positions [B, w], seen [B, w, slots seen]; a pair also sees its own slot (a padding
        pair nothing else sees, so its output stays finite)."""
        rope = self.core.draft_rope()
        seen = seen.scatter(2, slots[..., None], True).repeat(self.rows, 1, 1)
        rows = lambda t: t.repeat(self.rows, 1)  # noqa: E731
        return self.core._forward(states, rows(tokens), rope[rows(positions).clamp(0, rope.shape[0] - 1)], seen[:, None], rows(slots))
