"""EAGLE-style drafter folders, as LANTERN releases its LlamaGen drafters (``llamagen_drafter``).

A folder holds ``config.json`` (Hugging Face Llama fields, one hidden layer, and
``input_type``; ``"bias": false`` drops ``fc``'s bias) and its weights in Llama names
(docs/models.md, "A drafter folder"), with no input norm and its **own** ``embed_tokens``
(LANTERN copies the target's head into it and freezes it; the drafter reads its copy).
Its logits are the target's head on its states.

What LANTERN's drafter sees differs from specimg's EAGLE-1 in two ways:

- its cache starts with the whole caption: pair p = (the target's state after the final
  norm at condition position p, token 0) for p < cls_token_num - 1, then (the state at the
  last condition position, image token 0), image token k at slot context + k; it attends
  to every caption pair, padded ones included (the target's states there follow LANTERN's
  mask, :class:`~specimg.models.lantern.LanternTarget`);
- its RoPE is its own, fixed by ``input_type`` whatever the target's grid: LlamaGen's
  interleaved 2D table (base 10000) with ``context`` rows of zeros, then the grid
  (t2i: 16x16 after 119 zero rows, t2i2: 32x32 after 119, c2i: 24x24 after none).
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.models.checkpoint import load_into, read_checkpoint
from specimg.models.eagle import EagleDrafter, EagleTarget
from specimg.models.families import read_config
from specimg.models.lantern import config_value, layers_to_llamagen, weights_file
from specimg.models.llamagen import GPTConfig, rope_table

WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
"""In the order LANTERN tries them."""

GRIDS = {"t2i": (16, 119), "t2i2": (32, 119), "c2i": (24, 0)}
"""input_type -> (grid side, zero RoPE rows before it), as LANTERN's drafter hard-codes them."""


class FolderDrafter(EagleDrafter):
    """LANTERN's drafter: EAGLE-1 with its own token embedding, layer shape and RoPE table,
    and the caption's pairs in its cache before the image's (see the module docstring)."""

    kind = ""
    """Loaded from its folder; never written as a specimg drafter file."""

    def __init__(self, target: EagleTarget, layer_config: GPTConfig, grid: int, context: int, bias: bool, max_tree_nodes: int = 128) -> None:
        super().__init__(target, max_tree_nodes, layer_config, context, bias)
        self.embed_tokens = nn.Embedding(layer_config.vocab_size, layer_config.dim)
        self.grid = grid
        self._rope = self._rope_table()

    def _rope_table(self) -> Tensor:
        grid = attrs.evolve(self.layer_config, block_size=self.grid * self.grid, cls_token_num=1)
        cells = rope_table(grid)[1:]
        return torch.cat([cells.new_zeros(self.context, *cells.shape[1:]), cells]).to(self.embed_tokens.weight.device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._rope = self._rope_table()  # float32 on the weights' device, whatever their dtype
        return self

    def draft_rope(self) -> Tensor:
        return self._rope

    def embed(self, tokens: Tensor) -> Tensor:
        return self.embed_tokens(tokens)

    @torch.no_grad()
    def prefill(self, condition: Any, cfg: bool) -> None:
        """Reset, then cache the caption's pairs: the target's condition states (its
        ``condition_hidden``, after its own prefill) with token 0, at zero rotation."""
        super().prefill(condition, cfg)
        if not self.context:
            return
        states = self.target.condition_hidden()[:, : self.context].to(self.fc.weight.dtype)  # type: ignore[attr-defined]
        if states.shape[0] != self._rows:
            raise RuntimeError("prefill the target with the same cfg before the drafter")
        tokens = torch.zeros(self.context, dtype=torch.long, device=states.device)
        mask = torch.ones(self.context, self.context, dtype=torch.bool, device=states.device).tril()
        self._forward(states, tokens, self._rope[: self.context], mask, 0)
        self._len = self.context
        self._start.fill_(self.context)


def folder_config(config: dict[str, Any], target: EagleTarget, origin: str) -> tuple[GPTConfig, int, int]:
    """The draft layer's shape, its RoPE grid side and its context length, checked against
    the target it is loaded for."""
    kind = config.get("input_type")
    if not isinstance(kind, str) or kind not in GRIDS:
        raise SpecimgError(f"{origin}: input_type {kind!r} names no LANTERN drafter RoPE ({', '.join(GRIDS)}); other EAGLE folders are not supported yet")
    if config_value(config, "num_hidden_layers", origin) != 1:
        raise SpecimgError(f"{origin}: {config['num_hidden_layers']} draft layers; LANTERN's drafters have one")
    if config.get("qkv_bias"):
        raise SpecimgError(f"{origin}: q/k/v projections with a bias are not supported")
    dim, vocab = config_value(config, "hidden_size", origin), config_value(config, "vocab_size", origin)
    if (dim, vocab) != (target.hidden_size, target.vocab_size):
        raise SpecimgError(f"{origin}: a drafter of width {dim} and vocabulary {vocab}, for a target of width {target.hidden_size} and vocabulary {target.vocab_size}")
    grid, context = GRIDS[kind]
    cls = getattr(getattr(target, "config", None), "cls_token_num", None)
    if context and not hasattr(target, "condition_hidden"):
        raise SpecimgError(f"{origin}: this drafter reads the whole caption, which a {type(target).__name__} does not give")
    if context and cls != context + 1:
        raise SpecimgError(f"{origin}: an input_type {kind!r} drafter reads {context + 1} condition positions; the target has {cls}")
    if target.num_tokens > grid * grid:
        raise SpecimgError(f"{origin}: its {grid}x{grid} RoPE grid is smaller than the target's {target.num_tokens} image tokens")
    heads = config_value(config, "num_attention_heads", origin)
    layer = GPTConfig(
        dim=dim, n_layer=1, n_head=heads, n_kv_head=config.get("num_key_value_heads") or heads,
        ffn_dim=config_value(config, "intermediate_size", origin), norm_eps=config.get("rms_norm_eps", 1e-6),
        initializer_range=config.get("initializer_range", 0.02), vocab_size=vocab, block_size=target.num_tokens,
    )
    return layer, grid, context


def load_drafter_folder(target: EagleTarget, folder: str | os.PathLike[str], *, max_tree_nodes: int = 128) -> FolderDrafter:
    """The drafter of an EAGLE-style folder for ``target``, on its device and dtype."""
    origin = os.fspath(folder)
    config = read_config(origin)
    layer, grid, context = folder_config(config, target, origin)
    drafter = FolderDrafter(target, layer, grid, context, bool(config.get("bias", True)), max_tree_nodes)
    w = target.input_embeddings()
    state = {k: v.to(w.dtype) for k, v in read_checkpoint(weights_file(origin, WEIGHT_FILES)).state.items()}
    others = {k: v for k, v in state.items() if not k.startswith("layers.")}  # unknown keys keep their names: the strict load names them
    load_into(drafter, {**layers_to_llamagen(state, "", origin), **others}, origin=origin)
    target.requires_grad_(False)
    return drafter.to(device=w.device, dtype=w.dtype).eval()
