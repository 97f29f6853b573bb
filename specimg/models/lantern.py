"""LlamaGen's t2i GPT in Hugging Face Llama names, as LANTERN releases it (``LlamaGen-T2I``).

The folder holds ``config.json`` (``architectures: ["LlamaForCausalLM"]``, ``model_type:
"llama"``, plus LlamaGen's own fields: ``input_type`` "t2i", ``block_size``,
``cls_token_num``, ``caption_dim``, ``rope_base``) and ``model.safetensors`` (or
``pytorch_model.bin``) with LlamaGen's tensors under Llama names (:data:`LLAMA_NAMES`).
q/k/v are not permuted: the model keeps LlamaGen's interleaved 2D RoPE, so the weights load
into specimg's LlamaGen unchanged, q, k and v side by side in ``wqkv``.

One thing differs from LlamaGen: what a padded caption row sees under LANTERN's float mask
(:meth:`LanternTarget.condition_mask`).  Valid rows and image tokens never see a padded key
either way, so the logits are the same; the states at padded rows are not, and LANTERN's
drafters read them.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import Tensor

from specimg.errors import SpecimgError
from specimg.models.checkpoint import load_into, read_checkpoint
from specimg.models.families import read_config
from specimg.models.llamagen import GPTConfig, LlamaGenTarget
from specimg.models.options import torch_device, torch_dtype

LLAMA_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.cls_embedding.cap_proj.fc1.weight": "cls_embedding.cap_proj.fc1.weight",
    "model.cls_embedding.cap_proj.fc2.weight": "cls_embedding.cap_proj.fc2.weight",
    "model.cls_embedding.uncond_embedding": "cls_embedding.uncond_embedding",
}
"""Llama name -> specimg (LlamaGen) name, outside the decoder layers."""

LAYER_NAMES = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
"""A decoder layer's Llama names -> LlamaGen's; q_proj, k_proj and v_proj stack into ``attention.wqkv``."""

QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def weights_file(folder: str | os.PathLike[str], names: tuple[str, ...] = WEIGHT_FILES) -> str:
    """The folder's weights file: the first of ``names`` it holds."""
    for name in names:
        path = os.path.join(os.fspath(folder), name)
        if os.path.isfile(path):
            return path
    raise SpecimgError(f"{folder} holds no weights file ({' or '.join(names)})")


def layers_to_llamagen(state: dict[str, Tensor], prefix: str, origin: str) -> dict[str, Tensor]:
    """Decoder layers under ``{prefix}layers.i.`` in Llama names, in LlamaGen's names (from
    ``layers.i.``); any other key is left out, the caller maps it."""
    out: dict[str, Tensor] = {}
    layers = sorted({int(m[1]) for k in state if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", k))})
    for i in layers:
        head = f"{prefix}layers.{i}."
        missing = [head + name for name in QKV if head + name not in state]
        if missing:
            raise SpecimgError(f"{origin}: missing key {missing[0]!r}")
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat([state[head + name] for name in QKV])
        for key, value in state.items():
            if key.startswith(head) and key[len(head):] not in QKV:
                out[f"layers.{i}.{LAYER_NAMES.get(key[len(head):], key[len(head):])}"] = value
    return out


def config_value(config: dict[str, Any], key: str, origin: str, default: Any = None) -> Any:
    """``config[key]``, else ``default``; a key without a default is required."""
    if key in config:
        return config[key]
    if default is None:
        raise SpecimgError(f"{origin}: config.json has no {key!r}")
    return default


def target_config(config: dict[str, Any], origin: str) -> GPTConfig:
    """The LlamaGen config a LANTERN ``config.json`` describes (the FFN width is its
    ``intermediate_size``, the RoPE base its ``rope_base``: LlamaGen's 2D RoPE, not Llama's)."""
    if "input_type" not in config:
        raise SpecimgError(
            f"{origin}: a Llama folder that is no LlamaGen conversion (config.json has no input_type); "
            "specimg runs Llama-named folders only as LANTERN converts LlamaGen (LlamaGen-T2I)"
        )
    if config["input_type"] != "t2i":
        raise SpecimgError(f"{origin}: input_type {config['input_type']!r} is not supported; LANTERN's LlamaGen target folders are 't2i'")
    heads = config_value(config, "num_attention_heads", origin)
    return GPTConfig(
        dim=config_value(config, "hidden_size", origin), n_layer=config_value(config, "num_hidden_layers", origin), n_head=heads,
        n_kv_head=config.get("num_key_value_heads") or heads, ffn_dim=config_value(config, "intermediate_size", origin),
        rope_base=config_value(config, "rope_base", origin, 10000.0), norm_eps=config_value(config, "rms_norm_eps", origin, 1e-6),
        initializer_range=config_value(config, "initializer_range", origin, 0.02), vocab_size=config_value(config, "vocab_size", origin),
        model_type="t2i", cls_token_num=config_value(config, "cls_token_num", origin, 120),
        caption_dim=config_value(config, "caption_dim", origin), block_size=config_value(config, "block_size", origin),
    )


class LanternTarget(LlamaGenTarget):
    """LlamaGen t2i with LANTERN's caption mask (what its drafters were trained on)."""

    def condition_mask(self, caption_mask: Tensor, s: int | None = None) -> Tensor:
        """LlamaGen's mask, but a padded caption row attends as LANTERN's float mask makes it:
        every key it may see scores exactly 0 (queries and keys at condition positions are
        rotated by zero), so it attends uniformly over the keys whose mask value is highest:
        padded keys j <= i carry the weights' dtype minimum, valid keys j > i float32's
        (padded keys j > i their sum, never the highest).  In float32 the two are equal and
        it sees both sets; in half precision the dtype's minimum is higher, so only padded
        keys j <= i.  That is LANTERN's prefill, whose states its drafters read; in a longer
        float32 forward its padded rows also see the image tokens, which changes no other state."""
        mask = super().condition_mask(caption_mask, s)
        cls = self.config.cls_token_num
        below = torch.ones(cls, cls, dtype=torch.bool, device=caption_mask.device).tril()
        padded_before = ~caption_mask[:, None, :] & below
        valid_after = caption_mask[:, None, :] & ~below
        own, causal = torch.finfo(self.tok_embeddings.weight.dtype).min, torch.finfo(torch.float32).min
        seen = padded_before if own > causal else valid_after if own < causal else padded_before | valid_after
        rows = ~caption_mask[:, :, None]
        mask[:, :cls, :cls] = torch.where(rows, seen, mask[:, :cls, :cls])
        return mask


def load_lantern_target(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    max_tree_nodes: int = 128,
    **overrides: object,
) -> LanternTarget:
    """The LlamaGen t2i target of a LANTERN folder.  Its shape comes from its config.json
    alone: no preset or config override applies (each is refused)."""
    origin = os.fspath(path)
    if overrides:
        raise SpecimgError(f"{origin}: a LANTERN folder takes its shape from its config.json, not from {next(iter(overrides))!r} (options: device, dtype, max_tree_nodes)")
    device, dtype = torch_device(device), torch_dtype(dtype)
    config = target_config(read_config(path), origin)
    state = read_checkpoint(weights_file(path)).state
    if "model.cls_embedding.cap_proj.fc1.weight" not in state:
        raise SpecimgError(f"{origin}: its weights hold no model.cls_embedding: a Llama model, not a LlamaGen conversion")
    target = LanternTarget(config, max_tree_nodes)
    others = {LLAMA_NAMES.get(k, k): v for k, v in state.items() if not k.startswith("model.layers.")}  # an unknown key keeps its name
    load_into(target, {**layers_to_llamagen(state, "model.", origin), **others}, origin=origin)
    return target.to(device=device, dtype=dtype).eval()
