"""Where reading a tensor's value makes the host wait for the device's queued work: every
device but the CPU.  There a step's decisions run as device programs and the host reads
their outcome once (the acceptance walk, the relaxations' checks); on the CPU, where a
read costs nothing, they read as they go and skip work they can see is not needed.  Every
such choice asks :func:`host_reads_stall`, so a test can force the device forms on the
CPU by patching this one function."""

from __future__ import annotations

import torch
from torch import Tensor


def host_reads_stall(device: torch.device) -> bool:
    """Whether reading a tensor's value on ``device`` makes the host wait."""
    return device.type != "cpu"


def on_device(values: list[int], device: torch.device) -> Tensor:
    """Host integers as a long tensor on ``device``.  A plain copy to a CUDA device waits
    for the work queued before it; from pinned memory, without blocking, it joins the
    queue instead (torch keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
