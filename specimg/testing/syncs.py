"""Counting a run's host-device synchronisations: on CUDA as torch's sync debug mode
reports them, anywhere as the reads of tensor values that cause them."""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
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


_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def counting_host_reads() -> Iterator[Counter[str]]:
    """Count the Python-level reads of tensor values (``item``, ``tolist``, ``int(t)``, ...)
    inside the block: on a GPU each is a host-device synchronisation, so a CPU test can
    bound a step's synchronisations by counting them."""
    counts: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str, read: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return read(self, *args, **kwargs)

        return wrapper

    for name, read in saved.items():
        setattr(torch.Tensor, name, counted(name, read))
    try:
        yield counts
    finally:
        for name, read in saved.items():
            setattr(torch.Tensor, name, read)
