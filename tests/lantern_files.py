"""Tiny files in LANTERN's release formats, for tests: a specimg LlamaGen t2i target written
out as LANTERN's ``LlamaGen-T2I`` folder (Llama names), and drafter folders, written from
the naming tables alone (the inverse of what the loaders do)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from specimg.models.llamagen import GPTConfig, build_target

LAYER = {
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
OUTSIDE = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "cls_embedding.cap_proj.fc1.weight": "model.cls_embedding.cap_proj.fc1.weight",
    "cls_embedding.cap_proj.fc2.weight": "model.cls_embedding.cap_proj.fc2.weight",
    "cls_embedding.uncond_embedding": "model.cls_embedding.uncond_embedding",
}

# a LANTERN-shaped t2i target: 120 caption slots as LANTERN hard-codes, tiny widths, a 4x4 grid
TARGET = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=256, model_type="t2i", cls_token_num=120,
              caption_dim=12, block_size=16, initializer_range=0.1, norm_eps=1e-6)


def llama_layers(state: dict[str, Tensor], config: GPTConfig, prefix: str) -> dict[str, Tensor]:
    """Decoder layers in Llama names: wqkv split into q_proj, k_proj, v_proj."""
    out = {}
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    for key, value in state.items():
        if not key.startswith("layers."):
            continue
        _, i, rest = key.split(".", 2)
        head = f"{prefix}layers.{i}."
        if rest == "attention.wqkv.weight":
            for name, part in zip(("q_proj", "k_proj", "v_proj"), value.split([q, kv, kv])):
                out[f"{head}self_attn.{name}.weight"] = part.clone()
        else:
            out[head + LAYER[rest]] = value.clone()
    return out


def write_target(folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random specimg t2i target, written as a LANTERN folder; returns the target."""
    target = build_target("GPT-B", seed=seed, **{**TARGET, **overrides})
    c = target.config
    state = {k: v for k, v in target.state_dict().items()}
    tensors = {**llama_layers(state, c, "model."), **{OUTSIDE[k]: v.clone() for k, v in state.items() if not k.startswith("layers.")}}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.dim, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads, "intermediate_size": c.ffn_hidden,
        "rms_norm_eps": c.norm_eps, "vocab_size": c.vocab_size, "input_type": "t2i", "block_size": c.block_size,
        "cls_token_num": c.cls_token_num, "caption_dim": c.caption_dim, "rope_base": c.rope_base, "class_dropout_p": 0.0,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return target


# a LANTERN-shaped drafter for TARGET: its own heads, FFN width and norm epsilon
DRAFTER = dict(num_attention_heads=2, intermediate_size=96, rms_norm_eps=1e-6)


def write_drafter(folder: Path, target: torch.nn.Module, seed: int = 1, bias: bool = True, weights: str = "pytorch_model.bin", input_type: str = "t2i") -> dict[str, Tensor]:
    """A random LANTERN drafter folder for ``target`` (its embedding a copy of the target's
    head, as LANTERN makes it); returns its tensors in LANTERN's names."""
    g = torch.Generator().manual_seed(seed)
    h, v, ffn = target.config.dim, target.config.vocab_size, DRAFTER["intermediate_size"]

    def rand(*shape: int, scale: float = 0.1) -> Tensor:
        return torch.randn(*shape, generator=g) * scale

    tensors = {
        "embed_tokens.weight": target.output.weight.detach().clone(),
        "fc.weight": rand(h, 2 * h),
        **({"fc.bias": rand(h)} if bias else {}),
        **{f"layers.0.self_attn.{p}_proj.weight": rand(h, h) for p in "qkvo"},
        "layers.0.mlp.gate_proj.weight": rand(ffn, h),
        "layers.0.mlp.up_proj.weight": rand(ffn, h),
        "layers.0.mlp.down_proj.weight": rand(h, ffn),
        "layers.0.post_attention_layernorm.weight": 1 + rand(h),
    }
    folder.mkdir(parents=True, exist_ok=True)
    if weights.endswith(".safetensors"):
        save_file(tensors, folder / weights)
    else:
        torch.save(tensors, folder / weights)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "num_hidden_layers": 1,
        "num_key_value_heads": DRAFTER["num_attention_heads"], "vocab_size": v, "hidden_act": "silu", "input_type": input_type,
        "caption_dim": 2048, "class_dropout_p": 0.0, **DRAFTER, **({} if bias else {"bias": False}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    return tensors
