"""Counting a run's host-device synchronisations, as torch's CUDA sync debug mode reports them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch


def count_syncs(run: Callable[[], Any]) -> int:
    """How many times ``run()`` made the host wait for the CUDA device."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
