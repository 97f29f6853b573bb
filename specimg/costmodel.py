"""The machine's cost model as the planner reads it: what a tree costs to draft and to
verify, in milliseconds, per tree size and frontier width, and each method stack's
calibration.  Pure tables and arithmetic; the measuring is :mod:`specimg.costs`."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from specimg.profile import MAX_DEPTH, MAX_TOPK

VERIFY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
LEVEL_WIDTHS = (1, 2, 4, 6, 8, 10)


@attrs.frozen
class CostModel:
    """Measured milliseconds: ``verify`` per tree size (the target's forward and the
    processing of its logits), per top-k the drafting of an EAGLE-2 tree one level deep
    (``draft_base``: the root's children picked and the tree built) and each further level
    (``draft_level``: a drafter call for the frontier, its processing, the top-k), the
    drafter's ``draft_start`` per step (three new tokens), ``overhead`` per step (the
    acceptance walk, the commit, the planner's bookkeeping) and ``ar`` per AR token.
    Sizes in between interpolate linearly; beyond, extrapolate.  Per method stack (under
    its :func:`specimg.costs.scale_key`), from the decode that calibrated it (see
    :meth:`specimg.engine.Engine.prepare`): ``step_scales`` (:func:`specimg.costs.step_scale`)
    and ``acceptance``, the chances [depth][rank] its drafts were accepted with (the planner's prior)."""

    key: str
    machine: str
    verify_ms: tuple[tuple[int, float], ...]
    draft_base_ms: tuple[tuple[int, float], ...]
    draft_level_ms: tuple[tuple[int, float], ...]
    draft_start_ms: float
    overhead_ms: float
    ar_ms: float
    step_scales: Mapping[str, float] = attrs.field(factory=dict)
    acceptance: Mapping[str, tuple[tuple[float, ...], ...]] = attrs.field(factory=dict)

    def scale(self, method: str) -> float:
        return self.step_scales.get(method, 1.0)

    def calibrated(self, method: str) -> bool:
        return method in self.step_scales and method in self.acceptance

    def verify(self, nodes: np.ndarray | int) -> np.ndarray:
        return _interp(nodes, self.verify_ms)

    def draft(self, depth: int, topk: int) -> float:
        """An EAGLE-2 tree: the start, the first level, then depth - 1 levels of ``topk`` fed nodes."""
        return self.draft_start_ms + float(_interp(topk, self.draft_base_ms)) + (depth - 1) * float(_interp(topk, self.draft_level_ms))

    def step(self, depth: int, topk: int, nodes: np.ndarray | int, method: str = "") -> np.ndarray:
        return (self.verify(nodes) + self.draft(depth, topk) + self.overhead_ms) * self.scale(method)

    def slower(self, factor: float) -> CostModel:
        """These parts as if timed in a minute ``factor`` times slower (a shared machine's
        drift), uncalibrated: what a calibration must not be moved by (:func:`specimg.costs.step_scale`)."""
        scaled = {name: tuple((n, ms * factor) for n, ms in value) if isinstance(value, tuple) else value * factor
                  for name, value in attrs.asdict(self, recurse=False).items() if name.endswith("_ms")}
        return attrs.evolve(self, **scaled, step_scales={}, acceptance={})

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """The model a cache file holds; ValueError unless it is well-formed, with finite
        positive timings in tables as :func:`specimg.costs.measure` makes them: a corrupt
        cache is measured again, never planned on."""
        try:
            data = json.loads(text)
        except RecursionError:  # the C parser's answer to thousands of nested brackets
            raise ValueError("cost model nested too deeply") from None
        if not isinstance(data, dict) or not _FIELDS - {"step_scales", "acceptance"} <= set(data) <= _FIELDS:
            raise ValueError("not a cost model's fields")
        scales, acceptance = data.get("step_scales", {}), data.get("acceptance", {})
        if not isinstance(data["key"], str) or not isinstance(data["machine"], str) or not isinstance(scales, dict) or not isinstance(acceptance, dict):
            raise ValueError("cost model fields of the wrong type")
        return cls(
            data["key"], data["machine"], _table(data["verify_ms"], VERIFY_SIZES), *(_table(data[name], LEVEL_WIDTHS) for name in ("draft_base_ms", "draft_level_ms")),
            *(_positive(data[name]) for name in ("draft_start_ms", "overhead_ms", "ar_ms")),
            step_scales={method: _positive(scale) for method, scale in scales.items()},
            acceptance={method: _chances(rates) for method, rates in acceptance.items()},
        )


_FIELDS = frozenset(field.name for field in attrs.fields(CostModel))


_PLAUSIBLE = (1e-9, 1e9)
"""Milliseconds and scales a measurement can give: outside, a read-back number would only
overflow or vanish in the planner's arithmetic."""


def _positive(value: Any) -> float:
    """A timing or scale read back: a number in ``_PLAUSIBLE``, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number")
    with contextlib.suppress(OverflowError):  # an integer beyond any float
        if math.isfinite(value) and _PLAUSIBLE[0] <= value <= _PLAUSIBLE[1]:
            return float(value)
    raise ValueError(f"{value!r} is not a number in [{_PLAUSIBLE[0]:g}, {_PLAUSIBLE[1]:g}]")


def _chances(rows: Any) -> tuple[tuple[float, ...], ...]:
    """Acceptance chances read back: a [depth][rank] table of numbers in [0, 1] as the
    profile has them, or ValueError."""
    shape = (MAX_DEPTH, MAX_TOPK)
    if not isinstance(rows, list) or len(rows) != shape[0] or not all(isinstance(row, list) and len(row) == shape[1] for row in rows):
        raise ValueError(f"acceptance chances are not a {shape[0]} x {shape[1]} table")
    if not all(type(p) in (int, float) and 0.0 <= p <= 1.0 for row in rows for p in row):
        raise ValueError("an acceptance chance is not a number in [0, 1]")
    return tuple(tuple(float(p) for p in row) for row in rows)


def _table(rows: Any, sizes: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
    """A table read back: [size, ms] rows for the first two or more of ``sizes`` (as
    :func:`specimg.costs.measure` times them), times not decreasing, or ValueError."""
    if not isinstance(rows, list) or not all(isinstance(row, list) and len(row) == 2 for row in rows):
        raise ValueError("a cost table is not a list of [size, ms]")
    if len(rows) < 2 or not all(type(n) is int for n, _ in rows) or [n for n, _ in rows] != list(sizes[: len(rows)]):
        raise ValueError(f"a cost table's sizes are not the first two or more of {sizes}")
    table = tuple((n, _positive(ms)) for n, ms in rows)
    if any(a[1] > b[1] for a, b in zip(table, table[1:])):
        raise ValueError("a cost table's times decrease with size")
    return table


def _interp(x: np.ndarray | int, table: tuple[tuple[int, float], ...]) -> np.ndarray:
    xs, ys = np.array([n for n, _ in table], dtype=float), np.array([ms for _, ms in table])
    x = np.asarray(x, dtype=float)
    inside = np.interp(x, xs, ys)
    if len(xs) < 2:
        return inside
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), inside)
