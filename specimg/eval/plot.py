"""The bench plot, speedup against quality, through matplotlib (the ``plot`` extra).

It draws on a bare ``Figure`` (no pyplot), which renders with the Agg backend: headless,
and without touching the backend of a notebook that imports specimg.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from specimg.files import atomic_path

MISSING = "no bench.png: the plot needs matplotlib (pip install 'specimg[plot]')"


def scatter_plot(
    points: Sequence[tuple[str, float, float]],
    path: str | os.PathLike[str],
    x_label: str,
    y_label: str,
    title: str = "",
    hline: float | None = None,
) -> bool:
    """Write an 800x560 PNG: one labelled point per ``(label, x, y)`` (points with a
    non-finite coordinate are listed under the plot instead) and an optional dashed
    horizontal line.  False, and nothing written, when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(8, 5.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    good = [(label, x, y) for label, x, y in points if math.isfinite(x) and math.isfinite(y)]
    for i, (label, x, y) in enumerate(good):
        colour = f"C{i % 10}"
        ax.scatter([x], [y], color=colour, edgecolors="black", zorder=3)
        ax.annotate(label, (x, y), xytext=(6, 4), textcoords="offset points", color=colour)
    if hline is not None:
        ax.axhline(hline, linestyle="--", color="0.55", linewidth=1)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(True, color="0.92")
    ax.margins(0.15)
    bad = [label for label, x, y in points if not (math.isfinite(x) and math.isfinite(y))]
    if bad:
        fig.supxlabel("not plotted (no value): " + ", ".join(bad), color="#aa0000", fontsize=9)
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png")
    return True
