"""Safe checkpoint reading: safetensors, or torch.load with weights_only and an allow-list.

Released LlamaGen checkpoints wrap the weights as ``{"model": ...}``, ``{"ema": ...}``,
``{"module": ...}`` or ``{"state_dict": ...}`` and carry the training ``argparse.Namespace``
under ``args``; nothing else pickled is ever executed.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor

from specimg.errors import SpecimgError

_WRAPPER_KEYS = ("ema", "model", "module", "state_dict")
_ALLOWED_GLOBALS = [argparse.Namespace]


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a checkpoint file and return its flat tensor state dict (on CPU)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SpecimgError(f"checkpoint not found: {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
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
    return unwrap_state_dict(obj, path)


def _load_failure(err: Exception) -> str:
    """Why torch refused a file, in one line and without its advice to retry with
    ``weights_only=False``: that would run whatever code the file carries."""
    text = str(err)
    blocked = re.search(r"GLOBAL (\S+)", text)
    if blocked:
        return f"it holds a pickled {blocked[1]}, which no checkpoint of weights needs; it was not loaded"
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
        return "it is not a PyTorch checkpoint of weights, or it is damaged"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first or f"{type(err).__name__}; is it cut short?"


def unwrap_state_dict(obj: object, origin: str = "checkpoint") -> dict[str, Tensor]:
    """Find the tensor dict inside a released checkpoint's wrapper (EMA weights first)."""
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            if isinstance(obj.get(key), Mapping):
                return unwrap_state_dict(obj[key], origin)
        tensors = {k: v for k, v in obj.items() if isinstance(v, Tensor)}
        if tensors:
            return {_strip_prefix(k): v for k, v in tensors.items()}
    raise SpecimgError(f"{origin} holds no state dict (looked for raw tensors and keys {_WRAPPER_KEYS})")


def _strip_prefix(key: str) -> str:
    """DDP and torch.compile wrap module names; released files sometimes keep the prefix."""
    for prefix in ("module.", "_orig_mod."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


def load_into(module: torch.nn.Module, state: Mapping[str, Tensor], origin: str) -> None:
    """Copy ``state`` into ``module`` strictly, naming the first missing, unexpected or
    wrongly shaped key in a user-facing error."""
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
    module.load_state_dict(state, strict=True)
