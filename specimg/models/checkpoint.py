"""Safe checkpoint reading: safetensors, or torch.load with weights_only and an allow-list.

Released LlamaGen checkpoints wrap the weights as ``{"model": ...}``, ``{"ema": ...}``,
``{"module": ...}`` or ``{"state_dict": ...}`` and carry the training ``argparse.Namespace``
under ``args``; the allow-list admits exactly that class (rebuilt from its attribute
dict, never by running pickled code), so the args can say what model the file holds.

What a file says about its own shape (its args, its tensor shapes) is *described*; what a
caller passes is *given*.  :func:`settle` merges the two and refuses a contradiction, so a
checkpoint is never silently loaded into a model of another shape.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from specimg.errors import SpecimgError

_WRAPPER_KEYS = ("ema", "model", "module", "state_dict")
_ALLOWED_GLOBALS = [argparse.Namespace]


Described = dict[str, tuple[Any, str]]
"""Field -> (value, where the checkpoint says so), e.g. ``{"block_size": (576, "args image_size 384 / downsample_size 16")}``."""


@attrs.frozen(eq=False)
class Checkpoint:
    """A checkpoint's flat tensor state dict and its training args ({} when it has none)."""

    state: dict[str, Tensor]
    args: dict[str, Any]


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint file: its tensors (on CPU) and, for a .pt file, its ``args``."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SpecimgError(f"checkpoint not found: {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return Checkpoint(load_file(path, device="cpu"), {})
        except Exception as err:  # safetensors raises several types for a bad file
            raise SpecimgError(f"cannot read safetensors checkpoint {path}: {err}") from None
    if os.path.getsize(path) == 0:
        raise SpecimgError(f"checkpoint {path} is empty")
    try:
        with torch.serialization.safe_globals(_ALLOWED_GLOBALS), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of files it then refuses
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise SpecimgError(f"cannot read checkpoint {path} safely: {_load_failure(err)}") from None
    args = obj.get("args") if isinstance(obj, Mapping) else None
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    return Checkpoint(unwrap_state_dict(obj, path), dict(args) if isinstance(args, Mapping) else {})


def _load_failure(err: Exception) -> str:
    """Why torch refused a file, in one line and without its advice to retry with
    ``weights_only=False``: that would run whatever code the file carries."""
    text = str(err)
    blocked = re.search(r"GLOBAL (\S+)", text)
    if blocked:
        return f"it holds a pickled {blocked[1]}, which no checkpoint of weights needs; it was not loaded"
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
        return "it is not a PyTorch checkpoint of weights, or it is damaged"
    return first_line(err) if text.strip() else f"{type(err).__name__}; is it cut short?"


def first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def unwrap_state_dict(obj: object, origin: str = "checkpoint") -> dict[str, Tensor]:
    """Find the tensor dict inside a released checkpoint's wrapper (EMA weights first)."""
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            if isinstance(obj.get(key), Mapping):
                return unwrap_state_dict(obj[key], origin)
        tensors = {k: v for k, v in obj.items() if isinstance(v, Tensor)}
        if tensors:  # released files sometimes keep the prefixes DDP and torch.compile add to module names
            return {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in tensors.items()}
    raise SpecimgError(f"{origin} holds no state dict (looked for raw tensors and keys {_WRAPPER_KEYS})")


def check_finite(tensors: Iterable[tuple[str, Tensor]], origin: str) -> None:
    """Refuse weights holding NaN or inf: a damaged file or a diverged run, which would
    otherwise load and fail only at sampling, with a traceback about probabilities."""
    bad = [(name, t.dtype) for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        name, dtype = bad[0]
        raise SpecimgError(f"{origin}: {len(bad)} weight(s) hold NaN or inf values, the first {name!r} ({str(dtype).removeprefix('torch.')}); a damaged file or a diverged training run")


def load_into(module: torch.nn.Module, state: Mapping[str, Tensor], origin: str) -> None:
    """Copy ``state`` into ``module`` strictly, naming the first missing, unexpected or
    wrongly shaped key, or the first weight that is not finite, in a user-facing error."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing:
        raise SpecimgError(f"{origin}: missing key {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise SpecimgError(f"{origin}: unexpected key {unexpected[0]!r} ({len(unexpected)} unexpected in all); wrong preset?")
    for key, value in own.items():
        if key in state and state[key].shape != value.shape:
            raise SpecimgError(
                f"{origin}: key {key!r} has shape {tuple(state[key].shape)}, the model expects {tuple(value.shape)}; wrong preset or config?"
            )
    check_finite(state.items(), origin)
    module.load_state_dict(state, strict=True)


def agree(origin: str, *sources: Described) -> Described:
    """Join several descriptions of one checkpoint (its args, its shapes); two that disagree
    on a field mean a corrupt or mislabelled file."""
    out: Described = {}
    for source in sources:
        for key, (value, where) in source.items():
            if key in out and out[key][0] != value:
                raise SpecimgError(f"{origin}: {key} is {out[key][0]!r} by its {out[key][1]} but {value!r} by its {where}")
            out.setdefault(key, (value, where))
    return out


def settle(described: Described, overrides: Mapping[str, Any], origin: str, preset: str | None = None, preset_fields: Mapping[str, Any] = {}) -> dict[str, Any]:
    """The described fields overlaid with the given ones: ``preset`` (as a field) and its
    fields, then the caller's ``overrides``; a given value that contradicts a described one
    is a SpecimgError naming both (and the preset, when it gave it)."""
    given = {**({"preset": preset, **preset_fields} if preset is not None else {}), **overrides}
    for key, value in given.items():
        if key in described and described[key][0] != value:
            told, where = described[key]
            via_note = f" (by preset {preset})" if key in preset_fields and key not in overrides else ""
            raise SpecimgError(f"{origin}: {key} {value!r} was given{via_note}, but the checkpoint ({where}) has {told!r}; drop the override or use the right file")
    return {**{k: v for k, (v, _) in described.items()}, **given}
