"""The loading options every family takes (``--target-config device=cuda dtype=bfloat16``),
checked before anything is read or built, so a bad value is a SpecimgError naming it
rather than a failure deep inside torch after minutes of loading."""

from __future__ import annotations

import torch

from specimg.errors import SpecimgError


def torch_dtype(value: torch.dtype | str) -> torch.dtype:
    """A floating dtype, or its name (``"bfloat16"``)."""
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SpecimgError(f"dtype must be a floating torch dtype or its name (float32, bfloat16, float16), not {value!r}")
    return dtype


def torch_device(value: torch.device | str) -> torch.device:
    """A cpu or cuda device that this machine has, or its name (``"cuda:1"``)."""
    try:
        device = torch.device(value) if isinstance(value, (str, torch.device)) else None
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SpecimgError(f"device must be cpu, cuda or cuda:N, not {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecimgError(f"device {value!r}: this torch build or machine has no CUDA GPU; use cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SpecimgError(f"device {value!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device
