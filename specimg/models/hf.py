"""What the targets over transformers models share: loading a local Hugging Face folder
(never a download), the 4-D attention mask a draft tree needs, keeping a tree path in a
``DynamicCache``, the shape and positions of their EAGLE draft layer, and their outputs
as a TargetOutput."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch
from torch import Tensor

from specimg.errors import SpecimgError
from specimg.models.base import TargetOutput
from specimg.models.llamagen import GPTConfig, rope_1d

try:
    from transformers import AutoTokenizer, DynamicCache, PreTrainedModel
except ImportError as err:  # an optional extra: say which one
    raise SpecimgError("Hugging Face targets need transformers 4.57: pip install 'specimg[hf]'") from err


def torch_dtype(value: torch.dtype | str) -> torch.dtype:
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SpecimgError(f"dtype must be a floating torch dtype or its name, not {value!r}")
    return dtype


@attrs.frozen
class HFOptions:
    """Loading options.  The tree mask is a custom 4-D mask, which ``sdpa`` and ``eager``
    attention take and flash attention does not."""

    device: str | torch.device = "cpu"
    dtype: torch.dtype = attrs.field(default=torch.float32, converter=torch_dtype)
    attn_implementation: str = attrs.field(default="sdpa", validator=attrs.validators.in_(("sdpa", "eager")))


Options = TypeVar("Options", bound=HFOptions)
Model = TypeVar("Model", bound=PreTrainedModel)


def parse_options(cls: type[Options], overrides: dict[str, Any], family: str) -> Options:
    try:
        return cls(**overrides)
    except (TypeError, ValueError) as err:
        fields = ", ".join(f.name for f in attrs.fields(cls))
        raise SpecimgError(f"bad {family} option {sorted(overrides)}: {err} (options: {fields})") from None


def load_folder(path: str | os.PathLike[str], model_type: str, model_class: type[Model], options: HFOptions) -> tuple[Model, Any]:
    """The model of a local folder whose config says ``model_type``, in eval mode on the
    options' device and dtype, and the folder's text tokenizer (None when it has none)."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SpecimgError(f"{folder} is not a Hugging Face model folder (no config.json)")
    found = json.loads(config_file.read_text()).get("model_type")
    if found != model_type:
        raise SpecimgError(f"{folder} holds a {found!r} model, not a {model_type!r} one")
    model = model_class.from_pretrained(
        folder, local_files_only=True, dtype=options.dtype, attn_implementation=options.attn_implementation
    )
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True) if has_tokenizer else None
    return model.to(options.device).eval(), tokenizer


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean [rows, q, k] mask (True = attend) as the additive [rows, 1, q, k] mask the
    attention takes."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def keep_slots(cache: DynamicCache, start: int, src: Tensor) -> None:
    """Move the cache entries at slots ``src`` (in order) to ``start``, ``start + 1``, ... and
    drop everything after them."""
    m = src.shape[0]
    for layer in cache.layers:
        layer.keys[:, :, start : start + m] = layer.keys[:, :, src]
        layer.values[:, :, start : start + m] = layer.values[:, :, src]
    cache.crop(start + m)


def draft_config(text_config: Any, vocab_size: int, num_tokens: int) -> GPTConfig:
    """An EAGLE draft layer shaped like a layer of the Llama-style language model
    ``text_config``: its width, heads, KV heads, norm epsilon, RoPE base and init scale (the
    SwiGLU width as LlamaGen rounds it, 11008 for the 7B models' 4096, as theirs)."""
    return GPTConfig(
        dim=int(text_config.hidden_size), n_layer=1, n_head=int(text_config.num_attention_heads),
        n_kv_head=int(text_config.num_key_value_heads), rope_base=float(text_config.rope_theta),
        norm_eps=float(text_config.rms_norm_eps), initializer_range=float(text_config.initializer_range),
        vocab_size=vocab_size, block_size=num_tokens,
    )


def draft_rope(config: GPTConfig, positions: Tensor) -> Tensor:
    """The draft layer's 1-D RoPE at the image tokens' sequence positions (any offset: RoPE
    scores see only differences)."""
    return rope_1d(positions, config.head_dim, config.rope_base)


def target_output(out: Any, index: Any, code_logits: Callable[[Tensor], Tensor], exposed: Sequence[int]) -> TargetOutput:
    """A transformers language model's output at sequence slots ``index`` as a TargetOutput:
    logits and last hidden states, and the ``exposed`` layers' inputs side by side (EAGLE-3;
    ``hidden_states[i]`` is layer i's input) when there are any."""
    hidden = out.last_hidden_state[:, index]
    layers = torch.cat([out.hidden_states[i][:, index] for i in exposed], dim=-1) if exposed else None
    return TargetOutput(code_logits(hidden).float(), hidden, layers)

