"""EAGLE drafters for any target that lends them its pieces (:class:`EagleTarget`): the
tree machinery they share (:class:`TreeDrafter`), EAGLE-1 (below) and EAGLE-3
(:mod:`specimg.models.eagle3`), and their files.

As in EAGLE-1 (SafeAILab/EAGLE, ``eagle/model/cnets1.py``): ``fc`` (with bias) maps
concat[token embedding, target feature] to the width of the target, ONE decoder layer
follows whose input norm is dropped (EAGLE's layer 0 has no ``input_layernorm``), and its
output, the predicted next feature, goes straight to the target's LM head with no final
norm: the features it imitates are the target's last hidden states after the final norm.
The token embedding and the head are the target's own, shared and frozen.

Pair i is (the target's feature at the position before token i, token i) and sits at the
position of token i, rotated as the target rotates it (LlamaGen: its 2D RoPE of the grid
cell; Janus: 1-D RoPE of the sequence position; Lumina-mGPT: the same, counting the forced
newlines).  The drafter never sees the condition directly; it reaches it through the
features (row 1 holds the unconditional ones).
"""

from __future__ import annotations

import abc
import copy
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specimg import stalls
from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.compiled import FixedSteps, StepMode, bucket, run
from specimg.models.base import Condition, Target, cfg_rows
from specimg.models.checkpoint import load_into, read_checkpoint
from specimg.models.llamagen import GPTConfig, KVSlot, TransformerBlock, cache_is_stale, init_weights


@runtime_checkable
class EagleTarget(Target, Protocol):
    """What an EAGLE drafter borrows from its target, which every target family implements.

    The drafter's cache holds image-token pairs only, and RoPE scores depend only on the
    difference of positions: so a rotation table indexed by image token is all it needs,
    whatever the prompt's length or the row it is in (the unconditional row of CFG)."""

    def draft_config(self) -> GPTConfig:
        """The shape of the draft decoder layer (a LlamaGen layer): the target's width, heads,
        norm epsilon and init scale; ``block_size`` = num_tokens."""

    def draft_rope(self) -> Tensor:
        """[num_tokens, head_dim / 2, 2] float32 (cos, sin) on the target's device: the rotation
        at which image token k is consumed (pairs interleaved, as :func:`apply_rope` takes them)."""

    def embed_codes(self, tokens: Tensor) -> Tensor:
        """The target's input embedding of image tokens [...] -> [..., D]."""

    def code_logits(self, hidden: Tensor) -> Tensor:
        """Image-token logits [..., V] from last hidden states [..., D] (after the final norm)."""

    num_layers: int
    """Decoder layers (EAGLE-3 picks its low, middle and high ones among them)."""

    def expose_layers(self, layers: Sequence[int]) -> None:
        """From now on, outputs carry the inputs of these layers side by side
        (``TargetOutput.layers``; layer i's input is the state after i layers)."""


DRAFTER_TYPES = ("eagle1", "eagle3")
_DRAFTER_CLASSES: dict[str, type[TreeDrafter]] = {}
"""The drafter classes by type; EAGLE-3's registers when ``specimg.models`` imports its module."""


class TreeDrafter(FixedSteps, nn.Module, abc.ABC):
    """The :class:`~specimg.models.base.Drafter` interface over a one-layer EAGLE head with a
    static KV cache: a subclass says how a target feature becomes its state (``_lift``), how
    a (state, token) pair runs through its ``layers`` (``_forward``, after ``fc``'s weights
    in device and dtype) and how a state gives logits (``_logits``).

    Cache slot s holds the pair that consumes image token s (slot context + s for a drafter
    whose ``prefill`` caches pairs of the condition first); speculative nodes of the
    current step follow the committed slots and are forgotten by the next ``start``.  A
    node's input state is its parent's output state (the drafter's own prediction).

    ``start`` and ``expand`` also run at fixed shapes (:meth:`set_step_mode`): the new pairs
    or nodes padded to a bucket, written to cache slots given as a tensor, attending over
    the whole cache under a mask, compiled by ``torch.compile`` in the compiled step mode.
    """

    kind = ""
    """The drafter type a file records (``DRAFTER_TYPES``); a subclass that names one registers under it."""
    target: EagleTarget
    fc: nn.Linear
    layers: nn.ModuleList

    def __init__(self, target: EagleTarget, max_tree_nodes: int = 128, layer_config: GPTConfig | None = None, context: int = 0) -> None:
        """``layer_config``: the draft layer's own shape (default: the target's,
        ``draft_config``); ``context``: cache slots its :meth:`prefill` fills before the
        image's first pair (see :meth:`draft_rope`)."""
        super().__init__()
        config = layer_config or target.draft_config()
        object.__setattr__(self, "target", target)  # shared, not a submodule: kept out of state_dict
        self.layer_config = config
        self.max_tree_nodes = max_tree_nodes
        self.context = context
        self.capacity = context + config.block_size + max_tree_nodes
        self._full_kv: list[KVSlot] = []
        self._kv: list[KVSlot] = []  # the first prefill allocates the caches and the node tables
        self._rows = 0
        self._len = 0  # committed pairs
        self._count = 0  # speculative nodes fed since the last start
        self._batches: dict[tuple[int, bool], DraftBatch] = {}  # kept: their buffers live on from batch to batch

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            _DRAFTER_CLASSES[cls.kind] = cls

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._full_kv, self._kv = [], []
        self._batches = {}
        return self

    def replica(self) -> TreeDrafter:
        """A drafter that shares this one's weights and target but keeps its own cache: one
        per image of a batch (``Engine(batch_size=B)``)."""
        twin = copy.copy(self)
        twin._full_kv, twin._kv, twin._batches = [], [], {}
        return twin

    def batch(self, size: int, cfg: bool) -> DraftBatch:
        """The draft state of ``size`` images drafting together (``Engine(batch_size=B)``),
        kept for the next batch of that size: each image resets its own part as it begins,
        and the programs compiled on its buffers stay valid."""
        if (size, cfg) not in self._batches:
            self._batches[size, cfg] = DraftBatch(self, size, cfg)
        return self._batches[size, cfg]

    # -- Drafter protocol

    def draft_rope(self) -> Tensor:
        """The rotation of each cache slot [slots, head_dim / 2, 2]: the target's (slot k
        holds the pair consuming image token k) unless the drafter has its own."""
        return self.target.draft_rope()

    @torch.no_grad()
    def prefill(self, condition: Condition, cfg: bool) -> None:
        """Reset for a new image; the condition itself reaches the drafter only through features."""
        rows = cfg_rows(cfg)
        w = self.fc.weight
        if not self._full_kv or cache_is_stale(self._full_kv[0][0], w):
            c, n = self.layer_config, self.max_tree_nodes
            shape = (2, c.kv_heads, self.capacity, c.head_dim)
            self._full_kv = [(w.new_zeros(shape), w.new_zeros(shape)) for _ in self.layers]
            self._feat = w.new_zeros(2, 1 + n, c.dim)  # predicted feature per node (0 = root)
            self._depth = torch.zeros(1 + n, dtype=torch.long, device=w.device)  # depth below the root
            self._anc = torch.zeros(1 + n, 1 + n, dtype=torch.bool, device=w.device)  # speculative ancestors-or-self; row 0 empty
            self._start = torch.zeros((), dtype=torch.long, device=w.device)  # _len on the cache's device (the step programs read it there)
            self._slots = torch.arange(self.capacity, device=w.device)  # slot ids
        self._kv = [(k[:rows], v[:rows]) for k, v in self._full_kv]
        self._rows, self._len, self._count = rows, 0, 0
        self._start.zero_()

    @torch.no_grad()
    def start(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        m, s0 = tokens.shape[0], self._len
        if not self._kv:
            raise RuntimeError("call prefill before start (also after moving the drafter)")
        if s0 + m > self.capacity:
            raise ValueError(f"{m} new pairs overflow the drafter cache ({self.capacity - s0} slots left)")
        if self.step_mode == "eager":
            mask = torch.ones(m, s0 + m, dtype=torch.bool, device=self.fc.weight.device).tril(s0) if m > 1 else None
            h = self._forward(self._lift(hidden), tokens, self.draft_rope()[s0 : s0 + m], mask, s0)[:, -1]
            logits = self._logits(h).float()
        else:  # padded to a bucket, the padding pairs last
            size = bucket(m, self.capacity - s0)
            tokens = tokens.to(hidden.device)
            inputs = (F.pad(hidden, (0, 0, 0, size - m)), F.pad(tokens, (0, size - m))) if size > m else (hidden, tokens)
            h, logits = (t[:, m - 1] for t in self.run_fixed(TreeDrafter._start_step, *inputs))
        self._len, self._count = s0 + m, 0
        self._start.add_(m)
        self._feat[: self._rows, 0] = h
        return logits

    @torch.no_grad()
    def expand(self, parents: Tensor, tokens: Tensor) -> Tensor:
        f, c, s0 = tokens.shape[0], self._count, self._len
        if c + f > self.max_tree_nodes:
            raise ValueError(f"{c + f} draft nodes exceed max_tree_nodes={self.max_tree_nodes}")
        parents, tokens = parents.to(self.fc.weight.device), tokens.to(self.fc.weight.device)
        eager = self.step_mode == "eager"  # eager: the nodes at their exact shape, attention up to the last of them
        size = f if eager else bucket(f, self.max_tree_nodes - c)
        new = self._slots[c + 1 : c + 1 + size]  # ids c + 1, ... (a view: capacity > max_tree_nodes); padded nodes' ids are the next fed ones
        if size > f:
            parents, tokens = F.pad(parents, (0, size - f)), F.pad(tokens, (0, size - f))
        _, logits = self.run_fixed(TreeDrafter._expand_step, parents, tokens, new, s0 + c + f if eager else None)
        self._count = c + f
        return logits[:, :f]

    # -- fixed shapes

    def _start_step(self, hidden: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``start`` on device tensors: b new pairs (padded ones last, so nobody real sees
        them) at slots start + i (``_start``, read where it lives), each seeing the
        committed prefix and the new pairs before it."""
        b, start = tokens.shape[0], self._start
        slots = start + self._slots[:b]
        attn = (self._slots < start).expand(b, -1).clone()
        attn[:, slots] = torch.ones(b, b, dtype=torch.bool, device=attn.device).tril()
        rope = self.draft_rope()
        h = self._forward(self._lift(hidden), tokens, rope[slots.clamp(max=rope.shape[0] - 1)], attn, slots)
        return h, self._logits(h).float()

    def _expand_step(self, parents: Tensor, tokens: Tensor, new: Tensor, used: int | None = None) -> tuple[Tensor, Tensor]:
        """``expand`` on device tensors, its bookkeeping included: b nodes (padded ones last,
        children of the root) with ids ``new``, id j at slot prefix + j - 1; node i sees the
        committed prefix and its speculative ancestors-or-self among the first ``used`` slots
        (None: the whole cache, a fixed shape).  A padded node books and writes what the real
        node of its id, fed later, overwrites before anyone reads it."""
        prefix = self._start
        depth = self._depth[parents] + 1  # book the nodes: their depths and ancestors-or-self
        self._depth[new] = depth
        self._anc[new] = self._anc[parents].scatter_(1, new[:, None], True)  # a scalar fill, not a host value copied in: graph-safe
        slots = prefix - 1 + new
        attn = (self._slots < prefix).expand(new.shape[0], -1).clone()
        attn[:, prefix + self._slots[: self.max_tree_nodes]] = self._anc[new, 1:]
        rope = self.draft_rope()
        positions = (depth + prefix - 1).clamp(max=rope.shape[0] - 1)  # the root sits at prefix - 1
        h = self._forward(self._feat[: self._rows, parents], tokens, rope[positions], attn[:, :used], slots)
        self._feat[: self._rows, new] = h
        return h, self._logits(h).float()

    def embed(self, tokens: Tensor) -> Tensor:
        """Its input embedding of image tokens [...] -> [..., D]: the target's unless the
        drafter has its own table."""
        return self.target.embed_codes(tokens)

    def settings(self) -> dict[str, Any]:
        """What a file must record besides the weights to build this drafter again."""
        return {}

    @abc.abstractmethod
    def _lift(self, hidden: Tensor) -> Tensor:
        """The state [rows, m, D] of target features [rows, m, ...] (what ``start`` is given)."""

    @abc.abstractmethod
    def _forward(self, states: Tensor, tokens: Tensor, rope: Tensor, mask: Tensor | None, start: int | Tensor) -> Tensor:
        """Output states [rows, m, D] of pairs (input states [rows, m, D], tokens [m], or
        [rows, m] each row its own) written to cache slots from ``start`` (or to the slots
        in a ``start`` tensor, [rows, m] each row its own)."""

    @abc.abstractmethod
    def _logits(self, h: Tensor) -> Tensor:
        """Image-token logits [..., V] of states [..., D]."""


class EagleDrafter(TreeDrafter):
    """EAGLE-1: its state is a prediction of the target's last hidden state, so a target
    feature is a state as it is, and the target's own head scores it."""

    kind = "eagle1"

    def __init__(self, target: EagleTarget, max_tree_nodes: int = 128, layer_config: GPTConfig | None = None, context: int = 0, bias: bool = True) -> None:
        super().__init__(target, max_tree_nodes, layer_config, context)
        config = self.layer_config
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=bias)
        self.layers = nn.ModuleList([TransformerBlock(config, input_norm=False)])

    def _lift(self, hidden: Tensor) -> Tensor:
        return hidden

    def _logits(self, h: Tensor) -> Tensor:
        return self.target.code_logits(h)

    def forward_train(self, features: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced causal pass: features [B, T, D] (the target's states before
        tokens [B, T], as ``forward_sequence`` returns them).  Entry t predicts the feature
        at token t's position and the logits of token t + 1."""
        t = tokens.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()
        e = self.embed(tokens).to(features.dtype)
        h = self.fc(torch.cat([e, features], dim=-1))
        for layer in self.layers:
            h = layer(h, self.draft_rope()[:t], mask)
        return h, self.target.code_logits(h).float()

    def _forward(self, features: Tensor, tokens: Tensor, rope: Tensor, mask: Tensor | None, start: int | Tensor) -> Tensor:
        e = per_row(self.embed(tokens.to(features.device)), features.shape[0])
        h = self.fc(torch.cat([e, features], dim=-1))
        for layer, cache in zip(self.layers, self._kv):
            h = layer(h, rope, mask, cache, start)
        return h


# ----------------------------------------------------------------------------- batches
#
# A batch of images drafts their trees side by side (``Engine(batch_size=B)``); each image's
# drafter calls are those it would make alone (``start`` with its newly committed tokens,
# then ``expand`` level by level), but the calls of one kind are run together: one forward
# of the draft layer over every image.  Images may bring different numbers of tokens or
# nodes to a call and sit at different cache lengths, so each writes its own cache slots
# and sees its own prefix and tree ancestors.

DraftRequest = tuple[Tensor, Tensor]
"""One image's call to a :class:`DraftBatch`: (target features [rows, m, ...], tokens [m]) for ``start``, or
(parent node ids [f], tokens [f]) for ``expand``."""


class DraftBatch:
    """The draft state of ``size`` images over one drafter's weights: its caches hold image
    i's rows at r * size + i.  Images are known by index; an image not in a call's
    requests rides along on slots past its own nodes, which nothing reads."""

    def __init__(self, drafter: TreeDrafter, size: int, cfg: bool):
        if drafter.context:
            raise ValueError("a drafter that reads the whole condition drafts one image at a time")
        self.drafter, self.core = drafter, drafter.replica()  # the core keeps the batch's caches
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
        self.starts = torch.zeros(size, dtype=torch.long, device=w.device)  # lengths and counts on the device too,
        self.fed = torch.zeros(size, dtype=torch.long, device=w.device)  # so that a call copies nothing from the host

    @property
    def step_mode(self) -> StepMode:
        """The drafter's step mode: in the fixed ones every image may feed its nodes at once
        (:meth:`expand_all`)."""
        return self.drafter.step_mode

    def reset(self, image: int) -> None:
        """Image ``image`` starts a new picture (its drafter's ``prefill``)."""
        self.lengths[image], self.counts[image] = 0, 0
        self.starts[image], self.fed[image] = 0, 0

    def clear_nodes(self) -> None:
        """Every image forgets its speculative nodes, as after its start: a growth for every
        place (:meth:`expand_all`) then feeds from the first id on, whichever images drafted
        before it.  A tree grown already keeps its own columns."""
        self.counts = [0] * self.size
        self.fed.zero_()

    @torch.no_grad()
    def start(self, requests: Mapping[int, DraftRequest]) -> dict[int, Tensor]:
        """Each requesting image commits its m new pairs; their root logits [rows, V]."""
        core, images = self.core, list(requests)
        m = [int(tokens.shape[0]) for _, tokens in requests.values()]
        for i, count in zip(images, m):
            if self.lengths[i] + count > self.capacity:
                raise ValueError(f"{count} new pairs overflow the drafter cache ({self.capacity - self.lengths[i]} slots left)")
        width = max(m) if self.step_mode == "eager" else bucket(max(m), self.capacity - max(self.lengths))  # padding pairs: nobody sees them
        # every (row, image, pair) at once: where it goes in the [rows * size, width] inputs, and the last pair of each image
        pairs = [(r * self.size + i) * width + j for r in range(self.rows) for i, count in zip(images, m) for j in range(count)]
        ends = [(r * self.size + i) * width + count - 1 for r in range(self.rows) for i, count in zip(images, m)]
        at, last, placed, added = (stalls.on_device(v, self.device) for v in (pairs, ends, images, m))
        lifted = torch.cat([core._lift(hidden.to(self.device)) for hidden, _ in requests.values()], dim=1)  # [rows, pairs, D]: one lift per image, as alone
        states = self.feat.new_zeros(self.rows * self.size * width, self.feat.shape[-1])
        states[at] = lifted.flatten(0, 1)
        tokens = torch.zeros(self.size * width, dtype=torch.long, device=self.device)
        tokens[at[: sum(m)]] = torch.cat([new.to(self.device) for _, new in requests.values()])  # row 0's places: image i's pair j at i * width + j
        inputs = (states.view(self.rows * self.size, width, -1), tokens.view(self.size, width), last)
        used = max(self.lengths) + width if self.step_mode == "eager" else None  # eager: attention stops at the last slot any image uses
        root, logits = run(DraftBatch._start_step, self, *inputs, used, compiled=self.step_mode == "compiled")
        root, logits = root.view(self.rows, len(images), -1), logits.view(self.rows, len(images), -1)  # [rows, requests, ...]
        self.feat[:, 0].view(self.rows, self.size, -1)[:, placed] = root
        self.starts.index_add_(0, placed, added)
        self.fed[placed] = 0
        for i, count in zip(images, m):
            self.lengths[i] += count
            self.counts[i] = 0
        return {i: logits[:, k] for k, i in enumerate(images)}

    def _start_step(self, states: Tensor, tokens: Tensor, last: Tensor, used: int | None = None) -> tuple[Tensor, Tensor]:
        """``start``'s forward from device tensors alone: pair j of image i at slot
        lengths[i] + j (``starts``, read where it lives), seeing its prefix and itself among
        the first ``used`` slots (the whole cache: a fixed shape, a compiled program); the
        states and logits of the pairs at ``last``."""
        width = tokens.shape[1]
        slots = self.starts[:, None] + torch.arange(width, device=self.device)
        seen = torch.arange(used or self.capacity, device=self.device) < slots[..., None] + 1
        root = self._forward(states, tokens, slots, slots, seen).flatten(0, 1)[last]
        return root, self.core._logits(root).float()

    @torch.no_grad()
    def expand(self, requests: Mapping[int, DraftRequest]) -> dict[int, Tensor]:
        """Each requesting image feeds f nodes (children of its nodes ``parents``: 0 = root,
        k = its k-th node fed since its start); their logits [rows, f, V]."""
        images = list(requests)
        f = [int(tokens.shape[0]) for _, tokens in requests.values()]
        width = max(f)
        for i, count in zip(images, f):
            if self.counts[i] + count > self.max_nodes:
                raise ValueError(f"{self.counts[i] + count} draft nodes exceed max_tree_nodes={self.max_nodes}")
        # every fed node at once: its image, its column in the inputs and its node id (image i's count + 1, + 2, ...)
        owner = [i for i, count in zip(images, f) for _ in range(count)]
        column = [j for count in f for j in range(count)]
        ids = [self.counts[i] + 1 + j for i, count in zip(images, f) for j in range(count)]
        image, col, node_id, placed, added = (stalls.on_device(v, self.device) for v in (owner, column, ids, images, f))
        mine = torch.cat([parents.to(self.device) for parents, _ in requests.values()])
        self.depth[image, node_id] = self.depth[image, mine] + 1
        self.anc[image, node_id] = self.anc[image, mine]
        self.anc[image, node_id, node_id] = True
        parents = torch.zeros(self.size, width, dtype=torch.long, device=self.device)
        tokens = torch.zeros(self.size, width, dtype=torch.long, device=self.device)
        new = torch.zeros(self.size, width, dtype=torch.long, device=self.device)  # node ids (padding: id 0, never read)
        parents[image, col] = mine
        tokens[image, col] = torch.cat([fed.to(self.device) for _, fed in requests.values()])
        new[image, col] = node_id
        slots = (self.starts[:, None] + self.fed[:, None] + torch.arange(width, device=self.device)).clamp_(max=self.capacity - 1)
        used = min(self.capacity, max(n + c for n, c in zip(self.lengths, self.counts)) + width)  # attention stops there
        h = self._feed(parents, tokens, new, slots, used)
        logits = self.core._logits(h).float().view(self.rows, self.size, width, -1)
        h = h.view(self.rows, self.size, width, -1)
        self.feat.view(self.rows, self.size, *self.feat.shape[1:])[:, image, node_id] = h[:, image, col]
        self.fed[placed] += added
        for i, count in zip(images, f):
            self.counts[i] += count
        return {i: logits[:, i, :count] for i, count in zip(images, f)}

    @torch.no_grad()
    def expand_all(self, parents: Tensor, tokens: Tensor) -> Tensor:
        """Every image feeds f nodes at once, children of its nodes ``parents`` [B, f] (as
        :meth:`expand`), with ``tokens`` [B, f]; their logits [rows, B, f, V].  A fixed-shape
        program of device state alone (:meth:`_expand_all_step`), compiled in the compiled
        step mode."""
        width, counts = tokens.shape[1], set(self.counts)
        if tokens.shape[0] != self.size or len(counts) != 1:
            raise ValueError("expand_all feeds every image of the batch, each fed as many nodes as the others")
        fed = counts.pop()
        if fed + width > self.max_nodes:
            raise ValueError(f"{fed + width} draft nodes exceed max_tree_nodes={self.max_nodes}")
        logits = run(DraftBatch._expand_all_step, self, parents, tokens, fed, compiled=self.step_mode == "compiled")
        self.counts = [fed + width] * self.size
        return logits

    def _expand_all_step(self, parents: Tensor, tokens: Tensor, fed: int) -> Tensor:
        """:meth:`expand_all` on device tensors, every image having fed ``fed`` nodes: the
        nodes' ids and slots follow from that count, attention covers the whole cache
        under a mask."""
        width = tokens.shape[1]
        every_image = torch.arange(self.size, device=self.device)[:, None]
        new = (fed + 1 + torch.arange(width, device=self.device)).expand(self.size, -1)  # node ids fed + 1, ...
        self.depth[every_image, new] = self.depth.gather(1, parents) + 1
        self.anc[every_image, new] = self.anc[every_image, parents].scatter_(2, new[..., None], True)  # a scalar fill: graph-safe
        slots = (self.starts[:, None] + new - 1).clamp_(max=self.capacity - 1)  # node id j at slot length + j - 1
        h = self._feed(parents, tokens, new, slots, self.capacity)
        self.feat.view(self.rows, self.size, *self.feat.shape[1:])[:, every_image, new] = h.view(self.rows, self.size, width, -1)
        self.fed.fill_(fed + width)
        return self.core._logits(h).float().view(self.rows, self.size, width, -1)

    def _feed(self, parents: Tensor, tokens: Tensor, new: Tensor, slots: Tensor, used: int) -> Tensor:
        """The states [rows * B, w, D] of nodes ``new`` [B, w] (children of ``parents``, fed
        ``tokens``) written at cache ``slots``, each seeing its image's committed prefix and its
        ancestors-or-self among the first ``used`` slots (a padding node, id 0, the prefix)."""
        every_image = torch.arange(self.size, device=self.device)[:, None]
        first = self.starts[:, None]
        keys = torch.arange(used, device=self.device)
        node = (keys - first + 1)[:, None, :].expand(-1, tokens.shape[1], -1)  # the node at each slot past the prefix (ids past the tree: none)
        inside = (node >= 1) & (node <= self.max_nodes)
        seen = (keys < first)[:, None, :] | (inside & self.anc[every_image, new].gather(2, node.clamp(0, self.max_nodes)))
        states = self.feat.gather(1, parents.repeat(self.rows, 1)[..., None].expand(-1, -1, self.feat.shape[-1]))
        positions = self.depth[every_image, new] + first - 1  # the root sits at lengths[i] - 1
        return self._forward(states, tokens, slots, positions, seen)

    def _forward(self, states: Tensor, tokens: Tensor, slots: Tensor, positions: Tensor, seen: Tensor) -> Tensor:
        """The draft layer over every image's pairs: states [rows * B, w, D], tokens, slots,
        positions [B, w], seen [B, w, slots seen]; a pair also sees its own slot (a padding
        pair nothing else sees, so its output stays finite)."""
        rope = self.core.draft_rope()
        seen = seen.scatter(2, slots[..., None], True).repeat(self.rows, 1, 1)
        tokens, positions, slots = (t.repeat(self.rows, 1) for t in (tokens, positions, slots))  # image i's rows at r * B + i
        return self.core._forward(states, tokens, rope[positions.clamp(0, rope.shape[0] - 1)], seen[:, None], slots)


def per_row(embedded: Tensor, rows: int) -> Tensor:
    """Token embeddings [rows, m, D]: those of tokens [m] shared by every row, or of tokens
    [rows, m] (each row its own: a batch of images) as they are."""
    return embedded if embedded.dim() == 3 else embedded[None].expand(rows, -1, -1)


def build_drafter(target: EagleTarget, *, seed: int = 0, max_tree_nodes: int = 128, kind: str = "eagle1", **settings: Any) -> TreeDrafter:
    """A randomly initialised drafter of type ``kind`` (with its ``settings``) on the
    target's device and dtype.  The target is frozen (requires_grad off): only the
    drafter's own weights train."""
    if not isinstance(target, EagleTarget) or not isinstance(target, nn.Module):
        raise SpecimgError(f"an EAGLE drafter needs a target that lends it its pieces (EagleTarget); {type(target).__name__} does not")
    if kind not in _DRAFTER_CLASSES:  # each subclass registers under its ``kind``
        raise SpecimgError(f"unknown drafter type {kind!r}; choose one of {', '.join(DRAFTER_TYPES)}")
    cls = _DRAFTER_CLASSES[kind]
    target.requires_grad_(False)
    w = target.input_embeddings()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = cls(target, max_tree_nodes, **settings)
        init_weights(drafter, drafter.layer_config.initializer_range)
    return drafter.to(device=w.device, dtype=w.dtype).eval()


DRAFTER_KEY = "specimg.drafter"
"""A drafter file's header key: its type and settings as JSON (absent in EAGLE-1 files of old)."""


def save_drafter(drafter: TreeDrafter, path: str | os.PathLike[str]) -> None:
    """Write the drafter's own weights (not the shared embedding and head) as safetensors,
    atomically, with its type and settings in the header."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    if not drafter.kind:
        raise SpecimgError(f"a {type(drafter).__name__} is loaded from its own folder and is not saved as a specimg drafter file")
    if not path.endswith(".safetensors"):
        raise SpecimgError(f"drafter files are safetensors: name it *.safetensors, not {path}")
    meta = {"format": f"specimg-{drafter.kind}", DRAFTER_KEY: json.dumps({"type": drafter.kind, **drafter.settings()})}
    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, tmp, metadata=meta)


def load_drafter_file(target: EagleTarget, path: str | os.PathLike[str], *, max_tree_nodes: int = 128) -> TreeDrafter:
    """A drafter for ``target`` from a specimg drafter file, of the type its header records
    (EAGLE-1 for a file without one); a missing, extra or misshapen key (a drafter trained
    for another target) is a SpecimgError naming it.  :func:`specimg.models.load_drafter`
    takes EAGLE-style folders too."""
    path = os.fspath(path)
    settings: Any = {"type": "eagle1"}
    if path.endswith(".safetensors") and os.path.isfile(path):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                text = (f.metadata() or {}).get(DRAFTER_KEY)
            settings = json.loads(text) if text else settings
        except Exception as err:  # safetensors and json raise several types for a bad file
            raise SpecimgError(f"cannot read drafter file {path}: {err}") from None
        if not isinstance(settings, dict) or settings.get("type") not in DRAFTER_TYPES:
            raise SpecimgError(f"{path}: its header names no drafter type of {', '.join(DRAFTER_TYPES)}")
    drafter = build_drafter(target, max_tree_nodes=max_tree_nodes, kind=settings.pop("type"), **settings)  # on the target's device and dtype
    load_into(drafter, {k: v.to(drafter.fc.weight.dtype) for k, v in read_checkpoint(path).state.items()}, origin=path)
    return drafter
