"""Counting the Python a decode runs outside the models' forwards: its function calls, and
its bytecode instructions.

A step's Python time on a shared CPU is the difference of noisy figures; these counts are
the same on every run, so they show whether a batch step's Python grows with its images
(tests/test_batch.py, benchmarks/batch_overhead.py).  Calls weigh a one-line property as
much as a long loop; instructions weigh what each runs, and a loop over a batch's rows
shows up in them where it makes no call."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

from specimg.models.eagle import DraftBatch, TreeDrafter
from specimg.models.llamagen import LlamaGenTarget

MODEL_FORWARDS = {
    LlamaGenTarget: ("prefill", "forward_tree", "commit", "prefill_batch", "forward_batch", "forward_trees", "commit_trees", "refill"),
    TreeDrafter: ("prefill", "start", "expand"),
    DraftBatch: ("start", "expand"),
}
"""The models' methods that run their forwards (the target's and the drafter's, alone and batched)."""


def _forward_codes() -> set[CodeType]:
    """The code of :data:`MODEL_FORWARDS` as the classes hold it now (a wrapper patched over
    a method is what is stepped over)."""
    return {getattr(cls, name).__code__ for cls, names in MODEL_FORWARDS.items() for name in names}


C = TypeVar("C", bound="_Counter")


class _Counter:
    """A count over the Python this thread runs outside :data:`MODEL_FORWARDS` while on
    (``with``): ``_install`` (``sys.setprofile`` or ``sys.settrace``) sets ``_hook``.
    The methods are looked up when it is made, so a wrapper patched over them (a
    benchmark's timer) is what it steps over."""

    _install: Callable[[Any], None]

    def __init__(self) -> None:
        self._depth = 0  # how deep in the forwards the thread is
        self._forwards = _forward_codes()

    def __enter__(self: C) -> C:
        type(self)._install(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        type(self)._install(None)

    def _hook(self, frame: FrameType, event: str, arg: Any) -> Any:
        raise NotImplementedError


class CallCount(_Counter):
    """The Python function calls (a profile hook)."""

    _install = staticmethod(sys.setprofile)

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code in self._forwards:
            self._depth += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and not self._depth:
            self.calls += 1


class BytecodeCount(_Counter):
    """The bytecode instructions (a trace hook with opcode events: every instruction is a
    call into it, so a decode runs some ten times slower; for counting, not timing)."""

    _install = staticmethod(sys.settrace)

    def __init__(self) -> None:
        super().__init__()
        self.instructions = 0

    def _hook(self, frame: FrameType, event: str, arg: Any) -> Any:
        """A frame starts (or a generator resumes): trace its instructions, unless it is a
        forward or runs inside one."""
        if frame.f_code in self._forwards:
            self._depth += 1
            return self._forward
        if self._depth:
            return None
        frame.f_trace_opcodes = True
        return self._instruction

    def _forward(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self._depth -= 1
        return self._forward

    def _instruction(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.instructions += 1
        return self._instruction
