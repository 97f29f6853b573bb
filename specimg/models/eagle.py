"""EAGLE-1 drafter for a LlamaGen target.

As in EAGLE-1 (SafeAILab/EAGLE, ``eagle/model/cnets1.py``): ``fc`` (with bias) maps
concat[token embedding, target feature] to the width of the target, ONE decoder layer
follows whose input norm is dropped (EAGLE's layer 0 has no ``input_layernorm``), and its
output, the predicted next feature, goes straight to the target's LM head with no final
norm: the features it imitates are the target's last hidden states after the final norm.
The token embedding and the head are the target's own, shared and frozen.

Pair i is (the target's feature at the position before token i, token i) and sits at the
position of token i, with the target's 2D RoPE.  The drafter never sees the condition
directly; it reaches it through the features (row 1 holds the unconditional ones).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.models.base import Condition, cfg_rows
from specimg.models.checkpoint import load_into, load_state_dict
from specimg.models.llamagen import KVSlot, LlamaGenTarget, TransformerBlock, cache_is_stale, init_weights


class EagleDrafter(nn.Module):
    """The :class:`~specimg.models.base.Drafter` interface over an EAGLE-1 head.

    Cache slot s holds the pair that consumes image token s; speculative nodes of the
    current step follow the committed slots and are forgotten by the next ``start``.
    """

    target: LlamaGenTarget

    def __init__(self, target: LlamaGenTarget, max_tree_nodes: int = 128) -> None:
        super().__init__()
        config = target.config
        object.__setattr__(self, "target", target)  # shared, not a submodule: kept out of state_dict
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.layers = nn.ModuleList([TransformerBlock(config, input_norm=False)])
        self.max_tree_nodes = max_tree_nodes
        self.capacity = config.block_size + max_tree_nodes
        self._full_kv: list[KVSlot] = []
        self._kv: list[KVSlot] = []
        self._feat = torch.empty(0)  # [2, 1 + max_tree_nodes, D] predicted feature per node (0 = root)
        self._depth = torch.empty(0, dtype=torch.long)  # [1 + max_tree_nodes] depth below the root
        self._anc = torch.empty(0, dtype=torch.bool)  # [1 + n, 1 + n] speculative ancestors-or-self; row 0 empty
        self._rows = 0
        self._len = 0  # committed pairs
        self._count = 0  # speculative nodes fed since the last start
        self._root_pos = 0

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._full_kv, self._kv = [], []
        return self

    # -- Drafter protocol

    @torch.no_grad()
    def prefill(self, condition: Condition, cfg: bool) -> None:
        """Reset for a new image; the condition itself reaches the drafter only through features."""
        rows = cfg_rows(cfg)
        w = self.fc.weight
        if not self._full_kv or cache_is_stale(self._full_kv[0][0], w):
            c, n = self.target.config, self.max_tree_nodes
            shape = (2, c.kv_heads, self.capacity, c.head_dim)
            self._full_kv = [(w.new_zeros(shape), w.new_zeros(shape)) for _ in self.layers]
            self._feat = w.new_zeros(2, 1 + n, c.dim)
            self._depth = torch.zeros(1 + n, dtype=torch.long, device=w.device)
            self._anc = torch.zeros(1 + n, 1 + n, dtype=torch.bool, device=w.device)
        self._kv = [(k[:rows], v[:rows]) for k, v in self._full_kv]
        self._rows, self._len, self._count = rows, 0, 0

    @torch.no_grad()
    def start(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        m, s0 = tokens.shape[0], self._len
        if not self._kv:
            raise RuntimeError("call prefill before start (also after moving the drafter)")
        if s0 + m > self.capacity:
            raise ValueError(f"{m} new pairs overflow the drafter cache ({self.capacity - s0} slots left)")
        pos = self.target.config.cls_token_num + s0
        mask = None
        if m > 1:
            mask = torch.ones(m, s0 + m, dtype=torch.bool, device=self.fc.weight.device).tril(s0)
        h = self._forward(hidden, tokens, self.target.rope[pos : pos + m], mask, s0)
        self._len, self._count, self._root_pos = s0 + m, 0, pos + m - 1
        self._feat[: self._rows, 0] = h[:, -1]
        return self.target.output(h[:, -1]).float()

    @torch.no_grad()
    def expand(self, parents: Tensor, tokens: Tensor) -> Tensor:
        f, c, s0 = tokens.shape[0], self._count, self._len
        if c + f > self.max_tree_nodes:
            raise ValueError(f"{c + f} draft nodes exceed max_tree_nodes={self.max_tree_nodes}")
        device = self.fc.weight.device
        parents = parents.to(device)
        new = torch.arange(c + 1, c + f + 1, device=device)
        depth = self._depth[parents] + 1
        self._depth[new] = depth
        self._anc[new] = self._anc[parents]
        self._anc[new, new] = True
        positions = (depth + self._root_pos).clamp_(max=self.target.rope.shape[0] - 1)  # past the image end: never accepted
        mask = torch.cat([torch.ones(f, s0, dtype=torch.bool, device=device), self._anc[new, 1 : c + f + 1]], dim=1)
        h = self._forward(self._feat[: self._rows, parents], tokens, self.target.rope[positions], mask, s0 + c)
        self._feat[: self._rows, new] = h
        self._count = c + f
        return self.target.output(h).float()

    # -- training

    def forward_train(self, features: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced causal pass: features [B, T, D] (the target's states before
        tokens [B, T], as ``forward_sequence`` returns them).  Entry t predicts the feature
        at token t's position and the logits of token t + 1."""
        t, cls = tokens.shape[1], self.target.config.cls_token_num
        mask = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()
        e = self.target.tok_embeddings(tokens).to(features.dtype)
        h = self.fc(torch.cat([e, features], dim=-1))
        for layer in self.layers:
            h = layer(h, self.target.rope[cls : cls + t], mask)
        return h, self.target.output(h).float()

    def _forward(self, features: Tensor, tokens: Tensor, rope: Tensor, mask: Tensor | None, start: int) -> Tensor:
        e = self.target.tok_embeddings(tokens.to(features.device))[None].expand(features.shape[0], -1, -1)
        h = self.fc(torch.cat([e, features], dim=-1))
        for layer, cache in zip(self.layers, self._kv):
            h = layer(h, rope, mask, cache, start)
        return h


def build_drafter(target: LlamaGenTarget, *, seed: int = 0, max_tree_nodes: int = 128) -> EagleDrafter:
    """A randomly initialised drafter on the target's device and dtype.  The target is
    frozen (requires_grad off): only the drafter's own weights train."""
    target.requires_grad_(False)
    w = target.tok_embeddings.weight
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = EagleDrafter(target, max_tree_nodes)
        init_weights(drafter, target.config.initializer_range)
    return drafter.to(device=w.device, dtype=w.dtype).eval()


def save_drafter(drafter: EagleDrafter, path: str | os.PathLike[str]) -> None:
    """Write the drafter's own weights (not the shared embedding and head) as safetensors,
    atomically."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise SpecimgError(f"drafter files are safetensors: name it *.safetensors, not {path}")
    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, tmp, metadata={"format": "specimg-eagle1"})


def load_drafter(target: LlamaGenTarget, path: str | os.PathLike[str], *, max_tree_nodes: int = 128) -> EagleDrafter:
    """A drafter for ``target`` with weights from ``path``; a missing, extra or misshapen key
    (a drafter trained for another target) is a SpecimgError naming it."""
    drafter = build_drafter(target, max_tree_nodes=max_tree_nodes)
    w = target.tok_embeddings.weight
    state = {k: v.to(w.dtype) for k, v in load_state_dict(path).items()}
    load_into(drafter, state, origin=os.fspath(path))
    return drafter.to(w.device)
