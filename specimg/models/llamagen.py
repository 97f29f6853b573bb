"""LlamaGen's GPT (class- and text-conditional) as a speculative-decoding target.

An own compact implementation of the published architecture (FoundationVision/LlamaGen,
``autoregressive/models/gpt.py``) whose parameter names and shapes are those of the
official ``Transformer``, so released checkpoints load unchanged.  Facts kept from it:

- the 2D RoPE table has ``cls_token_num`` rows of (cos, sin) = (0, 0) for the condition,
  so queries and keys at condition positions are multiplied by zero (not left unrotated),
  then one row per grid cell: the first head_dim/4 pair frequencies follow the cell's row,
  the last head_dim/4 its column; pairs are interleaved (x[2i], x[2i+1]);
- image token k is consumed at sequence position cls_token_num + k;
- c2i CFG uses the extra class id ``num_classes``; t2i CFG feeds ``uncond_embedding``;
  caption tokens whose mask is 0 are attended by nobody but themselves, in both rows.

The KV cache is static: one tensor ``layers x (keys, values) x rows * images x kv_heads x
(cls + num_tokens + tree nodes) x head_dim`` (one image is a batch of one); draft-tree
entries sit right after the committed prefix until ``commit`` moves the accepted path down
(one gather for all layers).  Step
forwards run eagerly at their exact shape (the CPU's fastest) or at fixed shapes, compiled
by ``torch.compile`` (:meth:`LlamaGenTarget.set_step_mode`, :mod:`specimg.compiled`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specimg.config import LLAMAGEN_SAMPLING, LLAMAGEN_T2I_SAMPLING, Sampling
from specimg.errors import SpecimgError
from specimg.compiled import FixedSteps, bucket, static_address
from specimg.models.base import Caption, Condition, TargetOutput, cfg_rows, exposed_layers
from specimg.models.checkpoint import Checkpoint, Described, agree, load_into, read_checkpoint, settle
from specimg.models.options import torch_device, torch_dtype
from specimg.stalls import on_device

ModelType = Literal["c2i", "t2i"]


def _default_cls_tokens(config: GPTConfig) -> int:
    return 120 if config.model_type == "t2i" else 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _positive_int(value: object) -> bool:
    return _is_int(value) and value >= 1  # type: ignore[operator]


FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "dim": (_positive_int, "a positive integer"),
    "n_layer": (_positive_int, "a positive integer"),
    "n_head": (_positive_int, "a positive integer"),
    "n_kv_head": (lambda v: v is None or _positive_int(v), "a positive integer, or null for n_head"),
    "multiple_of": (_positive_int, "a positive integer"),
    "ffn_dim_multiplier": (lambda v: v is None or (_is_number(v) and v > 0), "a positive number, or null"),
    "ffn_dim": (lambda v: v is None or _positive_int(v), "a positive integer, or null for LlamaGen's rounding"),
    "rope_base": (lambda v: _is_number(v) and v > 1, "a finite number > 1"),
    "norm_eps": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    "initializer_range": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "vocab_size": (_positive_int, "a positive integer"),
    "num_classes": (_positive_int, "a positive integer"),
    "class_dropout_prob": (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "model_type": (lambda v: v in ("c2i", "t2i"), "'c2i' or 't2i'"),
    "cls_token_num": (_positive_int, "a positive integer"),
    "caption_dim": (_positive_int, "a positive integer"),
    "block_size": (lambda v: _is_int(v) and v >= 4 and math.isqrt(v) ** 2 == v, "a square >= 4 (image tokens form a grid, at least 2x2)"),
}
"""Each GPTConfig field's rule on its own, and what it asks for."""


def config_problems(fields: Mapping[str, object]) -> list[str]:
    """What is wrong with each of ``fields`` on its own (an unknown name, a type, a range),
    so that a bad override is refused before a checkpoint is read or a model built."""
    problems = []
    for key, value in fields.items():
        if key not in FIELD_RULES:
            problems.append(f"{key!r} is no field (fields: {', '.join(FIELD_RULES)})")
        elif not FIELD_RULES[key][0](value):
            problems.append(f"{key} must be {FIELD_RULES[key][1]}, not {value!r}")
    return problems


@attrs.frozen
class GPTConfig:
    """LlamaGen's ``ModelArgs`` minus training-only fields (dropout, batch limits)."""

    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None
    """The SwiGLU width where a file states it (a Hugging Face ``intermediate_size``); None: LlamaGen's rounding."""
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    vocab_size: int = 16384
    num_classes: int = 1000
    class_dropout_prob: float = 0.1
    model_type: ModelType = "c2i"
    cls_token_num: int = attrs.field(default=attrs.Factory(_default_cls_tokens, takes_self=True))
    caption_dim: int = 2048
    block_size: int = 256

    def __attrs_post_init__(self) -> None:
        problems = config_problems(attrs.asdict(self))
        if not problems:  # how the fields relate, once each is sound
            if self.dim % self.n_head:
                problems.append(f"dim {self.dim} is not a multiple of n_head {self.n_head}")
            elif self.head_dim % 4:
                problems.append(f"head_dim {self.head_dim} must be a multiple of 4 for 2D RoPE")
            if self.n_head % self.kv_heads:
                problems.append(f"n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")
        if problems:
            raise SpecimgError("bad GPT config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU width: ``ffn_dim`` if given, else rounded as LlamaGen does: int(2/3 * 4 dim),
        times the multiplier, up to a multiple of ``multiple_of``."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of


PRESETS: dict[str, dict[str, int]] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}
"""The official model sizes (``GPT_models`` in gpt.py); everything else keeps ModelArgs' defaults."""


def make_config(preset_or_config: str | GPTConfig = "GPT-B", **overrides: object) -> GPTConfig:
    """A preset name or a config, with field overrides (e.g. ``model_type="t2i"``)."""
    check_overrides(overrides)
    if isinstance(preset_or_config, GPTConfig):
        return attrs.evolve(preset_or_config, **overrides)
    return GPTConfig(**{**preset_fields(preset_or_config), **overrides})  # type: ignore[arg-type]


def check_overrides(overrides: Mapping[str, object]) -> None:
    """Refuse an override that is no GPTConfig field, or is of the wrong type or range."""
    problems = config_problems(overrides)
    if problems:
        raise SpecimgError("bad GPT config override: " + "; ".join(problems))


def preset_fields(name: object) -> dict[str, int]:
    """The fields a preset sets; an unknown name is a SpecimgError listing the presets."""
    if not isinstance(name, str) or name not in PRESETS:
        raise SpecimgError(f"unknown LlamaGen preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


# ----------------------------------------------------------------------------- layers


def rope_table(config: GPTConfig) -> Tensor:
    """LlamaGen's 2D RoPE as (cos, sin) pairs [cls + grid^2, head_dim/2, 2], float32."""
    half = config.head_dim // 2
    freqs = 1.0 / (config.rope_base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    angles = torch.outer(torch.arange(config.grid_size), freqs)  # [grid, head_dim/4]
    g = config.grid_size
    grid = torch.cat([angles[:, None, :].expand(g, g, -1), angles[None, :, :].expand(g, g, -1)], dim=-1)
    cells = torch.stack([grid.cos(), grid.sin()], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(config.cls_token_num, half, 2), cells])


def rope_1d(positions: Tensor, head_dim: int, base: float) -> Tensor:
    """Llama's 1-D RoPE at ``positions`` as (cos, sin) pairs [len, head_dim/2, 2], float32, in
    the layout :func:`apply_rope` takes (the draft layer of a Janus or Lumina-mGPT target)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = torch.outer(positions.float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate interleaved pairs of x [B, S, H, hd] by rope [S, hd/2, 2] (or [B, S, hd/2, 2]:
    each row its own positions), in float32: each pair (x0, x1) times cos + i sin as one
    complex product, which computes LlamaGen's (x0 cos - x1 sin, x1 cos + x0 sin) in one
    kernel instead of six."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    turns = torch.view_as_complex(rope.contiguous())
    turns = turns[:, :, None] if turns.dim() == 3 else turns[None, :, None]
    return torch.view_as_real(pairs * turns).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """LlamaGen's norm (float32 statistics, cast back, then the weight) in one fused call."""
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the additive one (0 or -inf) attention turns it into:
    built once per forward instead of once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


KVSlot = tuple[Tensor, Tensor]
"""One layer's static (keys, values) cache [rows, kv_heads, capacity, head_dim]."""


def cache_is_stale(cache: Tensor, weight: Tensor) -> bool:
    """A cache must follow the weights' device and dtype, and one made under inference_mode
    cannot be written outside it."""
    return (
        cache.device != weight.device
        or cache.dtype != weight.dtype
        or (cache.is_inference() and not torch.is_inference_mode_enabled())
    )


class Attention(nn.Module):
    """Multi-head attention; ``in_dim`` (default the width) is the width of its input (EAGLE-3's
    draft layer reads a token embedding and a state side by side)."""

    def __init__(self, config: GPTConfig, in_dim: int | None = None) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.wqkv = nn.Linear(in_dim or config.dim, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def project(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [B, H, S, hd] and keys, values [B, KV, S, hd] of x [B, S, D]."""
        b, s, _ = x.shape
        heads = self.n_head + self.n_kv_head
        qk, v = self.wqkv(x).split([heads * self.head_dim, self.n_kv_head * self.head_dim], dim=-1)
        qk = apply_rope(qk.view(b, s, heads, self.head_dim), rope).transpose(1, 2)  # queries and keys in one rotation
        return qk[:, : self.n_head], qk[:, self.n_head :], v.view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor | None, cache: KVSlot | None = None, start: int | Tensor = 0) -> Tensor:
        """x [B, S, D] at positions given by rope [S, ...]; with a cache, the new keys go to
        slots [start, start + S) and the queries see slots [0, start + S) under ``mask``
        (bool, True = attend, broadcast to [B, H, S, keys]; None = see all).  ``start`` a
        tensor instead (a fixed-shape step) of S slots, or [B, S] each row its own: the keys
        go there and the queries see the cache's first ``mask.shape[-1]`` slots."""
        s = x.shape[1]
        q, k, v = self.project(x, rope)
        if cache is not None:
            k_cache, v_cache = cache
            if isinstance(start, Tensor):
                index = start.expand(x.shape[0], -1)[:, None, :, None].expand_as(k)
                k_cache.scatter_(2, index, k)
                v_cache.scatter_(2, index, v)
                assert mask is not None
                k, v = k_cache[:, :, : mask.shape[-1]], v_cache[:, :, : mask.shape[-1]]
            else:
                k_cache[:, :, start : start + s] = k
                v_cache[:, :, start : start + s] = v
                k, v = k_cache[:, :, : start + s], v_cache[:, :, : start + s]
        return self.attend(q, k, v, mask)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """The output [B, S, D] of queries [B, H, S, hd] over keys and values [B, KV, keys, hd]."""
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).flatten(2))


class TransformerBlock(nn.Module):
    """A pre-norm decoder layer.  ``input_norm=False`` drops ``attention_norm``, as EAGLE-1
    does for its first draft layer (its input is already a mix of normed features)."""

    def __init__(self, config: GPTConfig, input_norm: bool = True) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm: nn.Module = RMSNorm(config.dim, config.norm_eps) if input_norm else nn.Identity()
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor | None, cache: KVSlot | None = None, start: int | Tensor = 0) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask, cache, start)
        return h + self.feed_forward(self.ffn_norm(h))


class LabelEmbedder(nn.Module):
    """Class labels; row ``num_classes`` is the null class when CFG dropout was trained."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(config.num_classes + int(config.class_dropout_prob > 0), config.dim)


class MLP(nn.Module):
    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Projects T5 caption features; ``uncond_embedding`` (a buffer, as released) is the
    caption of the unconditional row.  LlamaGen fixes it at 120 rows = its cls_token_num;
    here it has cls_token_num rows so tiny test models stay tiny."""

    uncond_embedding: Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.cap_proj = MLP(config.caption_dim, config.dim)
        self.register_buffer("uncond_embedding", torch.randn(config.cls_token_num, config.caption_dim) / config.caption_dim**0.5)


# ----------------------------------------------------------------------------- target


@attrs.define
class BatchCache:
    """The KV cache of ``prefill_batch``'s images, or of ``prefill``'s one: image i's rows
    at r * B + i, its committed entries ``lengths[i]`` (AR steps keep them equal, tree
    steps let them differ), ``valid`` [rows * B, slots] the slots a query may see (t2i:
    padded caption slots off), ``pending`` the nodes of the last tree step.  Tree steps and
    fixed-shape AR steps keep the lengths on the device too (``starts``), so that a step
    copies nothing from the host: one tensor for as long as the store lives, so that a
    graph may read it in place."""

    store: Tensor  # [layers, 2 (k, v), rows * B, heads, slots, head_dim]: one tensor, so a commit moves every layer's entries at once
    valid: Tensor | None
    rows: int
    lengths: list[int]
    starts: Tensor  # ``lengths`` on the device [B]
    pending: int = 0
    stale: bool = True  # ``starts`` behind ``lengths`` (after eager AR steps): copied in place at the next step that reads it
    caches: list[KVSlot] = attrs.field(init=False)  # per layer, views of ``store``

    def __attrs_post_init__(self) -> None:
        self.caches = [(k, v) for k, v in self.store]

    def device_lengths(self) -> Tensor:
        if self.stale:
            self.starts.copy_(on_device(self.lengths, self.starts.device))  # through pinned memory: the host does not wait for the queue
            self.stale = False
        return self.starts

    @property
    def capacity(self) -> int:
        return self.store.shape[4]


class LlamaGenTarget(FixedSteps, nn.Module):
    """LlamaGen's ``Transformer`` with the :class:`~specimg.models.base.Target` interface.
    One image (``prefill``, ``forward_tree``, ``commit``) is a batch of one, in a cache of
    its own apart from ``prefill_batch``'s."""

    def __init__(self, config: GPTConfig, max_tree_nodes: int = 128) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.num_tokens = config.block_size
        self.hidden_size = config.dim
        self.max_tree_nodes = max_tree_nodes
        self.num_layers = config.n_layer
        self.exposed: tuple[int, ...] = ()
        self.cls_embedding: nn.Module = LabelEmbedder(config) if config.model_type == "c2i" else CaptionEmbedder(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.rope = rope_table(config)  # float32 whatever the weights' dtype: not a buffer
        self._condition = torch.empty(0)  # the last prefill's last-layer outputs [rows, cls, D]
        self._one: BatchCache | None = None  # the image of prefill
        self._batch: BatchCache | None = None  # the images of prefill_batch

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Keep the RoPE table float32 on the weights' device and drop stale caches."""
        super()._apply(fn, recurse)
        self.rope = rope_table(self.config).to(self.tok_embeddings.weight.device)
        self._one = self._batch = None
        return self

    @property
    def default_sampling(self) -> Sampling:
        """LlamaGen's own: CFG 4 for c2i; CFG 7.5 and top-k 1000 for t2i."""
        return LLAMAGEN_T2I_SAMPLING if self.config.model_type == "t2i" else LLAMAGEN_SAMPLING

    # -- Target protocol

    def input_embeddings(self) -> Tensor:
        return self.tok_embeddings.weight.detach()

    @torch.no_grad()
    def prefill(self, condition: Condition, cfg: bool) -> TargetOutput:
        self._one, self._condition, out = self._open(self._one, [condition], cfg, self.max_tree_nodes)
        return out

    def condition_hidden(self) -> Tensor:
        """The last prefill's states after the final norm at every condition position
        [rows, cls_token_num, D]: what a drafter that reads the whole condition (LANTERN's)
        starts from."""
        if not self._condition.numel():
            raise RuntimeError("call prefill before condition_hidden")
        return self.norm(self._condition)

    @torch.no_grad()
    def forward_tree(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        one = self._opened(self._one, "prefill", "forward_tree")
        n, start = tokens.shape[0], one.lengths[0]
        if start + n > one.capacity:
            raise ValueError(f"tree of {n} nodes overflows the KV cache ({one.capacity - start} slots left)")
        if self.step_mode == "eager" and n == 1:  # the AR path: the root alone, depth 0; no per-step tensors built
            one.pending = 1
            return self._next(one, tokens.to(self.tok_embeddings.weight.device))
        return TargetOutput(*(out[:, 0] for out in self._trees(one, tokens[None], depths[None], mask[None])))

    @torch.no_grad()
    def commit(self, nodes: Tensor) -> None:
        one = self._opened(self._one, "prefill", "commit")
        if nodes.shape[0] > one.pending:
            raise ValueError(f"cannot commit {nodes.shape[0]} nodes of a {one.pending}-node tree")
        self._commit(one, [nodes])

    # -- what an EAGLE drafter borrows (specimg.models.eagle.EagleTarget)

    def draft_config(self) -> GPTConfig:
        return self.config

    def draft_rope(self) -> Tensor:
        """The 2D RoPE rows of the grid cells (image token k sits at cls_token_num + k)."""
        return self.rope[self.config.cls_token_num :]

    def embed_codes(self, tokens: Tensor) -> Tensor:
        return self.tok_embeddings(tokens)

    def expose_layers(self, layers: Sequence[int]) -> None:
        self.exposed = exposed_layers(layers, self.num_layers)

    def code_logits(self, hidden: Tensor) -> Tensor:
        return self.output(hidden)

    # -- teacher forcing

    def forward_sequence(self, conditions: Tensor | Sequence[Caption], tokens: Tensor) -> TargetOutput:
        """Whole images at once, for drafter training data.  ``conditions``: class ids [B]
        (``num_classes`` = unconditional) or one Caption per row; tokens [B, T].  Entry t is
        the state at the position before tokens[:, t] (its logits score tokens[:, t]); the
        last token is not consumed, as in LlamaGen's training."""
        cls = self.config.cls_token_num
        device = self.tok_embeddings.weight.device
        if self.config.model_type == "c2i":
            if not isinstance(conditions, Tensor):
                raise SpecimgError("a c2i target takes class ids as a tensor")
            cond, caption_mask = self.cls_embedding.embedding_table(conditions.to(device))[:, None], None
        else:
            if isinstance(conditions, Tensor):
                raise SpecimgError("a t2i target takes captions")
            feats, caption_mask = (torch.stack(t) for t in zip(*(self._caption(c) for c in conditions)))
            cond = self.cls_embedding.cap_proj(feats * caption_mask[..., None].to(feats.dtype))
        x = torch.cat([cond, self.tok_embeddings(tokens[:, :-1].to(device))], dim=1)
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        if caption_mask is not None:
            mask = self.condition_mask(caption_mask, s)[:, None]
        h, fused = self._run(x, self.rope[:s], mask, 0, [None] * len(self.layers))
        return self._head(h[:, cls - 1 :], fused if fused is None else fused[:, cls - 1 :])

    # -- batched steps (Engine(batch_size=B)): specimg.models.base.BatchTrees

    @torch.no_grad()
    def prefill_batch(self, conditions: Sequence[Condition], cfg: bool, tree_nodes: int = 0) -> TargetOutput:
        if tree_nodes > self.max_tree_nodes:
            raise ValueError(f"trees of {tree_nodes} nodes exceed max_tree_nodes={self.max_tree_nodes}")
        self._batch, _, out = self._open(self._batch, conditions, cfg, tree_nodes)
        return out

    @torch.no_grad()
    def forward_batch(self, tokens: Tensor) -> Tensor:
        batch = self._opened(self._batch, "prefill_batch", "forward_batch")
        if len(set(batch.lengths)) > 1:
            raise RuntimeError("forward_batch takes images at one length; tree steps left them apart (use forward_trees)")
        tokens = tokens.to(self.tok_embeddings.weight.device)
        if self.step_mode != "eager":  # a one-node tree per image, at the images' common length read on the device
            root, one = torch.zeros_like(tokens)[:, None], torch.ones(tokens.shape[0], 1, 1, dtype=torch.bool, device=tokens.device)
            logits = self._trees(batch, tokens[:, None], root, one)[0][:, :, 0]
            batch.starts.add_(1)
        else:
            logits = self._next(batch, tokens).logits
            batch.stale = True
        batch.lengths, batch.pending = [n + 1 for n in batch.lengths], 0
        return logits

    @torch.no_grad()
    def forward_trees(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        batch = self._opened(self._batch, "prefill_batch", "forward_trees")
        b, n = tokens.shape
        if b != len(batch.lengths):
            raise ValueError(f"{b} trees for a batch of {len(batch.lengths)} images")
        if max(batch.lengths) + n > batch.capacity:
            raise ValueError(f"trees of {n} nodes overflow the batch cache ({batch.capacity - max(batch.lengths)} slots left)")
        return TargetOutput(*self._trees(batch, tokens, depths, mask))

    @torch.no_grad()
    def commit_trees(self, paths: Sequence[Tensor]) -> None:
        batch = self._opened(self._batch, "prefill_batch", "commit_trees")
        counts = [int(p.shape[0]) for p in paths]
        if len(counts) != len(batch.lengths):
            raise ValueError(f"{len(counts)} paths for a batch of {len(batch.lengths)} images")
        if max(counts) > batch.pending:
            raise ValueError(f"cannot commit {max(counts)} nodes of {batch.pending}-node trees")
        self._commit(batch, paths)

    @torch.no_grad()
    def refill(self, image: int, condition: Condition) -> TargetOutput:
        batch = self._opened(self._batch, "prefill_batch", "refill")
        cls = self.config.cls_token_num
        fresh, _, out = self._open(None, [condition], batch.rows == 2, 0)  # the condition's cache, as prefill makes it
        rows = torch.arange(batch.rows, device=batch.store.device) * len(batch.lengths) + image
        batch.store[:, :, rows, :, :cls] = fresh.store[..., :cls, :]
        if batch.valid is not None:
            batch.valid[rows, :cls] = fresh.valid[:, :cls]  # (the later slots are never off)
        batch.lengths[image] = cls
        batch.starts[image] = cls
        return out

    # -- internals: one image's steps and a batch's, on a BatchCache

    @staticmethod
    def _opened(batch: BatchCache | None, first: str, caller: str) -> BatchCache:
        if batch is None:
            raise RuntimeError(f"call {first} before {caller} (also after moving the target)")
        return batch

    def _open(self, old: BatchCache | None, conditions: Sequence[Condition], cfg: bool, tree_nodes: int) -> tuple[BatchCache, Tensor, TargetOutput]:
        """A cache for one image per condition, with room for trees of ``tree_nodes``, the
        conditions consumed: the cache, the last layer's outputs [rows * B, cls, D] and the
        outputs [rows, B, ...] at the last condition position."""
        c, w = self.config, self.tok_embeddings.weight
        n, rows, cls = len(conditions), cfg_rows(cfg), c.cls_token_num
        embedded = [self.embed_condition(x, cfg) for x in conditions]
        prefix = torch.stack([e for e, _ in embedded], dim=1).flatten(0, 1)
        slots = cls + c.block_size + tree_nodes
        valid = None
        if c.model_type == "t2i":
            valid = torch.ones(rows * n, slots, dtype=torch.bool, device=w.device)
            valid[:, :cls] = torch.stack([m for _, m in embedded]).repeat(rows, 1)
        shape = (len(self.layers), 2, rows * n, c.kv_heads, slots, c.head_dim)
        if old is not None and old.store.shape == shape and old.starts.shape[0] == n and not cache_is_stale(old.store, w):
            store, starts = old.store, old.starts  # the same storage: programs compiled on it stay valid (stale slots are never seen)
            if valid is not None:
                valid = old.valid.copy_(valid) if old.valid is not None else valid
        else:
            store, starts = static_address(w.new_zeros(shape)), static_address(torch.zeros(n, dtype=torch.long, device=w.device))
        batch = BatchCache(store, valid, rows, [cls] * n, starts)
        h, fused = self._run(prefix, self.rope[:cls], None if valid is None else self.condition_mask(valid[:, :cls])[:, None], 0, batch.caches)
        return batch, h, self._last(batch, h[:, -1:], None if fused is None else fused[:, -1:])

    def _next(self, batch: BatchCache, tokens: Tensor) -> TargetOutput:
        """Each image's next token (tokens [B], the images at one length) at its exact shape,
        its cache entries written, the lengths left as they are: the outputs [rows, B, ...]."""
        start = batch.lengths[0]
        x = self.tok_embeddings(tokens.repeat(batch.rows))[:, None]
        attn = None if batch.valid is None else batch.valid[:, None, None, : start + 1]
        return self._last(batch, *self._run(x, self.rope[start : start + 1], attn, start, batch.caches))

    def _last(self, batch: BatchCache, h: Tensor, fused: Tensor | None) -> TargetOutput:
        """The outputs of one position per row, h [rows * B, 1, D], as [rows, B, ...]."""
        return TargetOutput(*(t if t is None else t.view(batch.rows, -1, t.shape[-1]) for t in self._head(h, fused)))

    def _trees(self, batch: BatchCache, tokens: Tensor, depths: Tensor, mask: Tensor) -> tuple[Tensor, ...]:
        """Every image's tree (checked to fit) at its own length: eagerly at its exact shape,
        else padded to a bucket (a padded node sees only itself and nobody sees it), one
        program each.  Outputs [rows, B, n, ...], as :meth:`_trees_step`'s."""
        (b, n), device = tokens.shape, self.tok_embeddings.weight.device
        tokens, depths, mask = (t.to(device) for t in (tokens, depths, mask))
        batch.device_lengths()
        batch.pending = n
        if self.step_mode == "eager":
            return self._trees_step(batch, tokens, depths, mask, max(batch.lengths) + n)
        size = bucket(n, min(self.max_tree_nodes, batch.capacity - max(batch.lengths)))  # the room left bounds it near the end
        if size > n:
            tree = torch.eye(size, dtype=torch.bool, device=device).repeat(b, 1, 1)
            tree[:, :n, :n] = mask
            tokens, depths, mask = F.pad(tokens, (0, size - n)), F.pad(depths, (0, size - n)), tree
        return tuple(out[:, :, :n] for out in self.run_fixed(LlamaGenTarget._trees_step, batch, tokens, depths, mask))

    def _trees_step(self, batch: BatchCache, tokens: Tensor, depths: Tensor, mask: Tensor, used: int | None = None) -> tuple[Tensor, ...]:
        """Every image's tree (tokens, depths [B, n], mask [B, n, n]) at its own length
        ``batch.starts`` [B], on device tensors only; queries see the first ``used`` slots
        (None: the whole cache, a fixed shape: a compiled program).
        Outputs [rows, B, n, ...]: logits, states and, where exposed, the layers' states."""
        (b, n), rows, device = tokens.shape, batch.rows, tokens.device
        used = used or batch.capacity
        first = batch.starts[:, None]
        slots = (first + torch.arange(n, device=device)).repeat(rows, 1)  # [rows * B, n]: node j of image i at lengths[i] + j
        positions = (depths + first).clamp_(max=self.rope.shape[0] - 1).repeat(rows, 1)  # past the image end: never accepted
        seen = (torch.arange(used, device=device) < first).repeat(rows, 1)  # the committed prefix
        if batch.valid is not None:
            seen &= batch.valid[:, :used]
        attn = seen[:, None].expand(-1, n, -1).clone()
        attn.scatter_(2, slots[:, None].expand(-1, n, -1), mask.repeat(rows, 1, 1))
        x = self.tok_embeddings(tokens).repeat(rows, 1, 1)
        h, fused = self._run(x, self.rope[positions], additive_mask(attn[:, None], x.dtype), slots, batch.caches)
        return tuple(t.view(rows, b, n, -1) for t in self._head(h, fused) if t is not None)

    def _commit(self, batch: BatchCache, paths: Sequence[Tensor]) -> None:
        """Keep image i's accepted nodes ``paths[i]`` (checked) of the last tree step."""
        counts = [int(p.shape[0]) for p in paths]
        device, m = self.tok_embeddings.weight.device, max(counts)
        if m > 1:  # a path's root is already in place (its slot is the image's length): only its later nodes move
            nodes = torch.nn.utils.rnn.pad_sequence([p[1:].to(device) for p in paths], batch_first=True, padding_value=-1)
            added = on_device(counts, device)
            batch.device_lengths()  # up to date before the step reads it in place
            self.run_fixed(LlamaGenTarget._commit_step, batch, nodes, added)
        else:  # nothing moves (AR's commit of the root): the device lengths follow the host's when next read
            batch.stale = True
        batch.lengths = [n + k for n, k in zip(batch.lengths, counts)]
        batch.pending = 0

    def _commit_step(self, batch: BatchCache, nodes: Tensor, counts: Tensor) -> tuple[()]:
        """:meth:`_commit` on device tensors only (a compiled program, one per longest
        path): image i's accepted nodes after its root, ``nodes[i]`` (-1 past its path),
        moved to the slots after its length, which then grows by ``counts[i]``."""
        store, start, later = batch.store, batch.starts, nodes.shape[1]
        dest = start[:, None] + torch.arange(1, later + 1, device=nodes.device)
        source = torch.where(nodes >= 0, start[:, None] + nodes, dest)  # past a path: stays put
        dest, source = (t.repeat(batch.rows, 1)[None, None, :, None, :, None] for t in (dest, source))
        index = source.expand(*store.shape[:2], -1, store.shape[3], -1, store.shape[5])
        store.scatter_(4, dest.expand_as(index), store.gather(4, index))
        start.add_(counts)
        return ()

    def _caption(self, caption: Caption) -> tuple[Tensor, Tensor]:
        c = self.config
        feats, mask = caption.features, caption.mask
        if feats.shape != (c.cls_token_num, c.caption_dim) or mask.shape != (c.cls_token_num,):
            raise SpecimgError(
                f"caption features {tuple(feats.shape)} / mask {tuple(mask.shape)} do not fit the target: "
                f"it expects [{c.cls_token_num}, {c.caption_dim}] / [{c.cls_token_num}] (LlamaGen left-pads T5 features)"
            )
        w = self.tok_embeddings.weight
        return feats.to(w.device, w.dtype), mask.to(w.device, torch.bool)

    def embed_condition(self, condition: Condition, cfg: bool) -> tuple[Tensor, Tensor | None]:
        """Condition rows [rows, cls, D] (row 1 unconditional) and the caption mask, if any."""
        c, device = self.config, self.tok_embeddings.weight.device
        if c.model_type == "c2i":
            if not isinstance(condition, int) or not 0 <= condition < c.num_classes:
                raise SpecimgError(f"a c2i target needs a class id in [0, {c.num_classes}), got {condition!r}")
            if cfg and c.class_dropout_prob <= 0:
                raise SpecimgError("this target has no null class (class_dropout_prob = 0): run without CFG")
            labels = torch.tensor([condition, c.num_classes][: cfg_rows(cfg)], device=device)
            return self.cls_embedding.embedding_table(labels)[:, None], None
        if not isinstance(condition, Caption):
            raise SpecimgError(f"a t2i target needs a Caption, got {type(condition).__name__}")
        feats, mask = self._caption(condition)
        feats = feats * mask[:, None].to(feats.dtype)  # LlamaGen's sampler zeroes padded features
        rows = torch.stack([feats, self.cls_embedding.uncond_embedding.to(feats.dtype)]) if cfg else feats[None]
        return self.cls_embedding.cap_proj(rows), mask

    def condition_mask(self, caption_mask: Tensor, s: int | None = None) -> Tensor:
        """Causal mask [B, s, s] in which padded caption tokens are seen only by themselves."""
        cls = self.config.cls_token_num
        s = cls if s is None else s
        causal = torch.ones(s, s, dtype=torch.bool, device=caption_mask.device).tril()
        valid = torch.ones(caption_mask.shape[0], s, dtype=torch.bool, device=caption_mask.device)
        valid[:, :cls] = caption_mask
        return (causal & valid[:, None, :]) | torch.eye(s, dtype=torch.bool, device=caption_mask.device)

    def _run(self, x: Tensor, rope: Tensor, mask: Tensor | None, start: int | Tensor, caches: Sequence[KVSlot | None]) -> tuple[Tensor, Tensor | None]:
        """The last layer's output and the exposed layers' inputs side by side (None: none exposed)."""
        taps: dict[int, Tensor] = {}
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if i in self.exposed:
                taps[i] = x
            x = layer(x, rope, mask, cache, start)
        return x, torch.cat([taps[i] for i in self.exposed], dim=-1) if taps else None

    def _head(self, h: Tensor, layers: Tensor | None) -> TargetOutput:
        h = self.norm(h)
        return TargetOutput(self.output(h).float(), h, layers)


# ----------------------------------------------------------------------------- construction

_DERIVED_KEYS = ("freqs_cis", "causal_mask")
"""Tables some LlamaGen files carry although they are recomputed, never trained."""


def init_weights(module: nn.Module, std: float) -> None:
    """LlamaGen's init (normal(0, std) for Linear and Embedding, zero biases), except the
    output head, which LlamaGen zeroes: a random model must give informative logits."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def build_target(preset_or_config: str | GPTConfig = "GPT-B", *, seed: int = 0, max_tree_nodes: int = 128, **overrides: object) -> LlamaGenTarget:
    """A randomly initialised target (deterministic in ``seed``), in eval mode."""
    config = make_config(preset_or_config, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = LlamaGenTarget(config, max_tree_nodes)
        init_weights(target, config.initializer_range)
    return target.eval()


def describe_checkpoint(checkpoint: Checkpoint, origin: str = "checkpoint") -> Described:
    """What a LlamaGen checkpoint says about its shape.  Its training args (official files
    save them): ``gpt_model`` (the preset), ``image_size // downsample_size`` (the grid, so
    block_size), ``vocab_size``, ``cls_token_num``, ``gpt_type``, ``num_classes``.  Its
    tensors: width, depth and vocabulary, t2i or c2i, caption width and slots, and the grid
    when the file carries the RoPE table."""
    args, state = checkpoint.args, checkpoint.state
    told: Described = {}
    if isinstance(args.get("gpt_model"), str):
        told["preset"] = (args["gpt_model"], "args")
    if isinstance(args.get("image_size"), int) and isinstance(args.get("downsample_size"), int) and args["downsample_size"] > 0:
        grid = args["image_size"] // args["downsample_size"]
        told["block_size"] = (grid * grid, f"args (image_size {args['image_size']} / downsample_size {args['downsample_size']})")
    for key, field in (("vocab_size", "vocab_size"), ("cls_token_num", "cls_token_num"), ("num_classes", "num_classes"), ("gpt_type", "model_type"), ("model_type", "model_type")):
        if args.get(key) is not None:
            told[field] = (args[key], "args")
    seen: Described = {}
    if "tok_embeddings.weight" in state:
        vocab, dim = state["tok_embeddings.weight"].shape
        seen.update(vocab_size=(int(vocab), "weights"), dim=(int(dim), "weights"))
    layers = {k.split(".")[1] for k in state if k.startswith("layers.")}
    if layers:
        seen["n_layer"] = (len(layers), "weights")
    if "cls_embedding.uncond_embedding" in state:
        slots, caption_dim = state["cls_embedding.uncond_embedding"].shape
        seen.update(model_type=("t2i", "weights"), cls_token_num=(int(slots), "weights"), caption_dim=(int(caption_dim), "weights"))
    elif "cls_embedding.embedding_table.weight" in state:
        seen["model_type"] = ("c2i", "weights")
    described = agree(origin, told, seen)
    if "freqs_cis" in state and state["freqs_cis"].dim() == 3:  # [cls + grid^2, head_dim / 2, 2]
        default_cls = 120 if described.get("model_type", ("c2i",))[0] == "t2i" else 1
        cells = state["freqs_cis"].shape[0] - described.get("cls_token_num", (default_cls,))[0]
        described = agree(origin, described, {"block_size": (int(cells), "RoPE table")})
    return described


def config_for(described: Described, preset: str | None, overrides: dict[str, object], origin: str) -> GPTConfig:
    """The config a checkpoint needs: its own description, the given preset and overrides
    on top (a contradiction is an error naming both values).  Underneath, the preset of the
    weights' width and depth (unique per preset; the head count is in no shape), else GPT-B.
    A fork's model that is no preset (its args name, say, "GPT-S") loads once its head
    count is given: width and depth come from its weights, the rest are ModelArgs' defaults."""
    fields = settle(described, overrides, origin, preset, preset_fields(preset) if preset is not None else {})
    sized = [n for n, p in PRESETS.items() if (p["dim"], p["n_layer"]) == (fields.get("dim"), fields.get("n_layer"))]
    name = fields.pop("preset", sized[0] if len(sized) == 1 else "GPT-B")
    if name not in PRESETS:
        if not {"dim", "n_layer", "n_head"} <= fields.keys():
            raise SpecimgError(
                f"{origin}: its args name the model {name!r}, which is no LlamaGen preset ({', '.join(PRESETS)}); "
                "give its head count (--target-config n_head=N; its width and depth come from its weights)"
            )
        name = "GPT-B"  # the fields a preset sets are all given: it adds nothing
    if "n_head" not in fields and fields.get("dim", PRESETS[name]["dim"]) != PRESETS[name]["dim"]:
        raise SpecimgError(
            f"{origin}: its weights (dim {fields['dim']}, {fields.get('n_layer')} layers) match no LlamaGen preset; "
            "give the head count (--target-config n_head=N)"
        )
    return make_config(name, **fields)


def load_target(
    path: str | os.PathLike[str],
    preset: str | GPTConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    max_tree_nodes: int = 128,
    **overrides: object,
) -> LlamaGenTarget:
    """Load an official (or compatible) LlamaGen checkpoint.

    The shape comes from the checkpoint itself where it says (:func:`describe_checkpoint`),
    then from ``preset`` and ``overrides`` (e.g. ``block_size=576`` for a 384px file without
    args); a given value that contradicts the file, a key the file lacks, an extra key or a
    mismatched shape is a SpecimgError naming it.  A :class:`GPTConfig` is taken as is.
    Every option is checked on its own before the file is read.
    """
    origin = os.fspath(path)
    device, dtype = torch_device(device), torch_dtype(dtype)
    if not _positive_int(max_tree_nodes):
        raise SpecimgError(f"max_tree_nodes must be a positive integer, not {max_tree_nodes!r}")
    if preset is not None and not isinstance(preset, GPTConfig):
        preset_fields(preset)
    check_overrides(overrides)
    checkpoint = read_checkpoint(path)
    if isinstance(preset, GPTConfig):
        config = make_config(preset, **overrides)
    else:
        config = config_for(describe_checkpoint(checkpoint, origin), preset, overrides, origin)
    state = {k: v for k, v in checkpoint.state.items() if k not in _DERIVED_KEYS and ".kv_cache." not in k}
    target = LlamaGenTarget(config, max_tree_nodes)
    load_into(target, state, origin=origin)
    return target.to(device=device, dtype=dtype).eval()
