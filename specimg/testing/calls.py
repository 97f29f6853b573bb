"""Counting the Python function calls a decode makes outside the models' forwards.

A step's Python time on a shared CPU is the difference of noisy figures; the number of
calls it makes is the same on every run, so it shows whether a batch step's Python grows
with its images (tests/test_batch.py, benchmarks/batch_overhead.py)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from specimg.models.eagle import DraftBatch, TreeDrafter
from specimg.models.llamagen import LlamaGenTarget

MODEL_FORWARDS = {
    LlamaGenTarget: ("prefill", "forward_tree", "commit", "prefill_batch", "forward_batch", "forward_trees", "commit_trees", "refill"),
    TreeDrafter: ("prefill", "start", "expand"),
    DraftBatch: ("start", "expand"),
}
"""The models' methods that run their forwards (the target's and the drafter's, alone and batched)."""


class CallCount:
    """The Python function calls made on this thread outside :data:`MODEL_FORWARDS` while
    on (a profile hook).  The methods are looked up when it is made, so a wrapper patched
    over them (a benchmark's timer) is what it steps over."""

    def __init__(self) -> None:
        self.calls, self._depth = 0, 0
        self._forwards = {getattr(cls, name).__code__ for cls, names in MODEL_FORWARDS.items() for name in names}

    def __enter__(self) -> CallCount:
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code in self._forwards:
            self._depth += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and not self._depth:
            self.calls += 1
