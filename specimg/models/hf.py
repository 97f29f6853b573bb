"""What the targets over transformers models share: loading a local Hugging Face folder
(never a download), checking prompt ids, the 4-D attention mask a draft tree needs, keeping a tree path in a
``DynamicCache``, and what :class:`HFTarget` keeps: the cache of a prefill and a tree, the
shape and positions of their EAGLE draft layer, and their outputs as a TargetOutput."""

from __future__ import annotations

import operator
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch
from safetensors import SafetensorError
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.models.base import TargetOutput, exposed_layers
from specimg.models.checkpoint import check_finite, first_line
from specimg.models.families import read_config
from specimg.models.llamagen import GPTConfig, rope_1d
from specimg.models.options import torch_device, torch_dtype

try:
    from transformers import AutoTokenizer, DynamicCache, PreTrainedModel
    from transformers.utils import logging as hf_logging
except ImportError as err:  # an optional extra: say which one
    raise SpecimgError("Hugging Face targets need transformers 4.57: pip install 'specimg[hf]'") from err

ATTENTION = ("sdpa", "eager")


def _attention(value: object) -> str:
    if value not in ATTENTION:
        raise ValueError(f"attn_implementation must be sdpa or eager (a draft tree needs a custom 4-D mask, which flash attention does not take), not {value!r}")
    return value  # type: ignore[return-value]


@attrs.frozen
class HFOptions:
    """Loading options.  The tree mask is a custom 4-D mask, which ``sdpa`` and ``eager``
    attention take and flash attention does not."""

    device: torch.device = attrs.field(default="cpu", converter=torch_device)
    dtype: torch.dtype = attrs.field(default=torch.float32, converter=torch_dtype)
    attn_implementation: str = attrs.field(default="sdpa", converter=_attention)


Options = TypeVar("Options", bound=HFOptions)
Model = TypeVar("Model", bound=PreTrainedModel)


def parse_options(cls: type[Options], overrides: dict[str, Any], family: str) -> Options:
    """The family's options from ``overrides``, each checked before anything is loaded."""
    fields = [f.name for f in attrs.fields(cls)]
    unknown = [key for key in overrides if key not in fields]
    if unknown:
        raise SpecimgError(f"{family} folders take no option {unknown[0]!r} (their options: {', '.join(fields)})")
    try:
        return cls(**overrides)
    except ValueError as err:
        raise SpecimgError(f"bad {family} option: {err}") from None


def load_folder(
    path: str | os.PathLike[str], model_type: str, model_class: type[Model], options: HFOptions, unused: tuple[str, ...] = ()
) -> tuple[Model, Any]:
    """The model of a local folder whose config says ``model_type``, in eval mode on the
    options' device and dtype (its weights checked by :func:`load_pretrained`, ``unused``
    passed on), and the folder's text tokenizer (None when it has none)."""
    folder = Path(path)
    found = read_config(folder).get("model_type")
    if found != model_type:
        raise SpecimgError(f"{folder} holds a {found!r} model, not a {model_type!r} one")
    model = load_pretrained(model_class, folder, unused, dtype=options.dtype, attn_implementation=options.attn_implementation)
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True) if has_tokenizer else None
    return model.to(options.device).eval(), tokenizer


def load_pretrained(model_class: type[Model], folder: str | os.PathLike[str], unused: tuple[str, ...] = (), **kwargs: Any) -> Model:
    """``model_class.from_pretrained`` on a local folder, refusing what transformers would
    load with randomly initialised weights (missing, or of another shape: another model's
    folder, a damaged export) or silently drop (unexpected ones), and weights that are not
    finite; its warnings about them are not printed, the error says it in one line.
    ``unused``: name prefixes of parts specimg never runs, left alone (a T5 encoder cut from
    a whole T5 folder, whose ``lm_head`` it does not have)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = model_class.from_pretrained(folder, local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    except (SafetensorError, pickle.UnpicklingError) as err:
        raise SpecimgError(f"a weights file in {folder} is cut short or damaged: {first_line(err)}") from None
    except (OSError, ValueError, RuntimeError) as err:  # no weights file, a .bin torch cannot read...
        raise SpecimgError(f"cannot load {folder}: {first_line(err)}") from None
    finally:
        hf_logging.set_verbosity(level)
    kinds = {"missing": info["missing_keys"], "unexpected": info["unexpected_keys"], "of another shape than its config.json gives": info["mismatched_keys"]}
    wrong = {kind: sorted(k for k in keys if not k.startswith(unused)) for kind, keys in kinds.items()}
    found = [f"{len(keys)} {kind} (first {keys[0]!r})" for kind, keys in wrong.items() if keys]
    if found:
        raise SpecimgError(f"{folder} does not hold the weights its config.json describes: {'; '.join(found)}; another model's weights, or a damaged export?")
    check_finite(((k, t) for k, t in model.state_dict().items() if not k.startswith(unused)), os.fspath(folder))
    return model


def given_prompt_ids(condition: Tensor | Sequence[int], vocab_size: int, family: str) -> Tensor:
    """Prompt ids [L] taken as they are, checked: one non-empty sequence of integers in the
    language model's vocabulary, as an id past it would index past the embedding table (a
    traceback on CPU, a device-side assert on a GPU)."""
    try:
        ids = [operator.index(i) for i in (condition.tolist() if isinstance(condition, Tensor) else condition)]
    except TypeError:
        raise SpecimgError(f"a {family} target takes a prompt text or prompt ids (one sequence of integers), not {type(condition).__name__}") from None
    if not ids:
        raise SpecimgError("prompt ids must be one non-empty sequence")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise SpecimgError(f"prompt id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long)


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


class HFTarget(nn.Module):
    """A target over a transformers model (``text_config``: its language model's): the model
    in eval mode, its folder's text tokenizer, the layers it exposes, the EAGLE draft layer it
    lends and its outputs as TargetOutputs.  Moving the weights drops the cache and the tables
    made from them (the draft RoPE, the input embeddings)."""

    vocab_size: int
    num_tokens: int

    def __init__(self, model: PreTrainedModel, text_config: Any, text_tokenizer: Any) -> None:
        super().__init__()
        self.model = model.eval()
        self.text_tokenizer = text_tokenizer
        self.text_config = text_config
        self.hidden_size = int(text_config.hidden_size)
        self.num_layers = int(text_config.num_hidden_layers)
        self.exposed: tuple[int, ...] = ()
        self._cache: DynamicCache | None = None
        self._rope: Tensor | None = None  # draft_rope(), computed once per device
        self._table: Tensor | None = None  # input_embeddings(), computed once per weights
        self._rows = 0
        self._len = 0  # committed cache slots
        self._codes = 0  # committed image codes
        self._pending: Tensor | None = None  # the last tree's cache slots per node (see commit)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._cache, self._rope, self._table = None, None, None
        return self

    @torch.no_grad()
    def input_embeddings(self) -> Tensor:
        """[V, D]: each image code's input embedding (:meth:`embed_codes`)."""
        if self._table is None:
            self._table = self.embed_codes(torch.arange(self.vocab_size, device=self._device)).detach()
        return self._table

    @property
    def _device(self) -> torch.device:
        return self.model.device

    def draft_config(self) -> GPTConfig:
        """An EAGLE draft layer shaped like a layer of the Llama-style language model: its
        width, heads, KV heads, norm epsilon, RoPE base and init scale (the SwiGLU width as
        LlamaGen rounds it, 11008 for the 7B models' 4096, as theirs)."""
        c = self.text_config
        return GPTConfig(
            dim=int(c.hidden_size), n_layer=1, n_head=int(c.num_attention_heads),
            n_kv_head=int(c.num_key_value_heads), rope_base=float(c.rope_theta),
            norm_eps=float(c.rms_norm_eps), initializer_range=float(c.initializer_range),
            vocab_size=self.vocab_size, block_size=self.num_tokens,
        )

    def draft_rope(self) -> Tensor:
        """The draft layer's 1-D RoPE at the image tokens' sequence positions
        (:meth:`code_positions`; any offset: RoPE scores see only differences)."""
        if self._rope is None:
            config = self.draft_config()
            self._rope = rope_1d(self.code_positions(), config.head_dim, config.rope_base)
        return self._rope

    def code_positions(self) -> Tensor:
        """The sequence position of each image token [num_tokens], counted from image token 0."""
        raise NotImplementedError

    def expose_layers(self, layers: Sequence[int]) -> None:
        self.exposed = exposed_layers(layers, self.num_layers)

    def embed_codes(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def code_logits(self, hidden: Tensor) -> Tensor:
        raise NotImplementedError

    def _start(self, model: Any, rows: int, length: int, **inputs: Any) -> TargetOutput:
        """A new cache holding the condition, ``length`` slots in ``rows`` rows, run through
        ``model`` (the language model): the outputs at its last slot."""
        self._cache = DynamicCache()
        self._rows, self._len, self._codes, self._pending = rows, length, 0, None
        return self._run(model, slice(-1, None), **inputs)

    def _open_tree(self) -> int:
        """The committed length, once the entries of a tree left uncommitted are dropped."""
        if self._cache is None:
            raise RuntimeError("call prefill before forward_tree (also after moving the target)")
        self._cache.crop(self._len)
        return self._len

    def _run(self, model: Any, index: Any, **inputs: Any) -> TargetOutput:
        out = model(**inputs, past_key_values=self._cache, use_cache=True, output_hidden_states=bool(self.exposed))
        return self._head(out, index)

    @torch.no_grad()
    def commit(self, nodes: Tensor) -> None:
        """Keep the cache slots of ``nodes`` from the last tree: ``_pending`` holds each
        node's slot [n], or its slot and then that of a token fed after it [n, 2] (-1: none)."""
        if self._cache is None or self._pending is None:
            raise RuntimeError("call forward_tree before commit")
        if nodes.shape[0] > self._pending.shape[0]:
            raise ValueError(f"cannot commit {nodes.shape[0]} nodes of a {self._pending.shape[0]}-node tree")
        src = self._pending[nodes.to(self._device)]
        if src.dim() > 1:
            src = src[src >= 0]
        keep_slots(self._cache, self._len, src + self._len)
        self._len, self._codes, self._pending = self._len + src.shape[0], self._codes + nodes.shape[0], None

    def _head(self, out: Any, index: Any) -> TargetOutput:
        """The language model's output at sequence slots ``index``: logits and last hidden
        states, and the exposed layers' inputs side by side (EAGLE-3; ``hidden_states[i]`` is
        layer i's input) when there are any."""
        hidden = out.last_hidden_state[:, index]
        layers = torch.cat([out.hidden_states[i][:, index] for i in self.exposed], dim=-1) if self.exposed else None
        return TargetOutput(self.code_logits(hidden).float(), hidden, layers)
