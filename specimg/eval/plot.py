"""A labelled scatter plot (speedup against quality) drawn with Pillow alone, so that
``specimg bench`` needs no plotting library."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

from specimg.images import save_png_atomic

_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo
    step = 10 ** math.floor(math.log10(span / count)) if span > 0 else 1.0
    for mult in (1, 2, 5, 10):
        if span / (step * mult) <= count:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float, ticks: Sequence[float]) -> str:
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else abs(v) or 1.0
    if abs(v) >= 1e5:
        return f"{v:.2e}"
    return f"{v:.{max(0, -math.floor(math.log10(step)))}f}"


def scatter_plot(
    points: Sequence[tuple[str, float, float]],
    path: str | os.PathLike[str],
    x_label: str,
    y_label: str,
    title: str = "",
    hline: float | None = None,
    size: tuple[int, int] = (800, 560),
) -> None:
    """Write a PNG: one labelled point per ``(label, x, y)`` (points with a non-finite
    coordinate are listed under the plot instead), an optional dashed horizontal line."""
    width, height = size
    font = ImageFont.load_default()
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 80, 30, 40, 90
    good = [(lab, x, y) for lab, x, y in points if math.isfinite(x) and math.isfinite(y)]
    bad = [lab for lab, x, y in points if not (math.isfinite(x) and math.isfinite(y))]
    xs = [x for _, x, _ in good] or [0.0, 1.0]
    ys = [y for _, _, y in good] + ([hline] if hline is not None else []) or [0.0, 1.0]

    def pad(lo: float, hi: float) -> tuple[float, float]:
        span = hi - lo or max(abs(hi), 1.0) * 0.2
        return lo - 0.1 * span, hi + 0.1 * span

    x0, x1 = pad(min(xs), max(xs))
    y0, y1 = pad(min(ys), max(ys))
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    draw.rectangle([left, top, left + pw, top + ph], outline="black")
    xt, yt = _ticks(x0, x1), _ticks(y0, y1)
    for t in xt:
        draw.line([px(t), top + ph, px(t), top + ph + 5], fill="black")
        draw.line([px(t), top, px(t), top + ph], fill="#eeeeee")
        draw.text((px(t) - 12, top + ph + 8), _fmt(t, xt), fill="black", font=font)
    for t in yt:
        draw.line([left - 5, py(t), left, py(t)], fill="black")
        draw.line([left, py(t), left + pw, py(t)], fill="#eeeeee")
        draw.text((left - 50, py(t) - 6), _fmt(t, yt), fill="black", font=font)
    draw.rectangle([left, top, left + pw, top + ph], outline="black")
    if hline is not None and y0 <= hline <= y1:
        x = left
        while x < left + pw:
            draw.line([x, py(hline), min(x + 6, left + pw), py(hline)], fill="#888888")
            x += 12
    placed = [(px(x) - 6, py(y) - 6, px(x) + 6, py(y) + 6) for _, x, y in good]  # labels avoid the points too

    def free(box: tuple[float, float, float, float]) -> bool:
        inside = box[0] >= left + 2 and box[2] <= left + pw - 2 and box[1] >= top + 2 and box[3] <= top + ph - 2
        return inside and not any(box[0] < b[2] and box[2] > b[0] and box[1] < b[3] and box[3] > b[1] for b in placed)

    for i, (lab, x, y) in enumerate(good):
        colour = _COLOURS[i % len(_COLOURS)]
        cx, cy = px(x), py(y)
        draw.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=colour, outline="black")
        tw = draw.textlength(lab, font=font)
        spots = [(cx + 8, cy - 14), (cx + 8, cy + 2), (cx - 8 - tw, cy - 14), (cx - 8 - tw, cy + 2), (cx - tw / 2, cy - 22), (cx - tw / 2, cy + 8)]
        spots += [(sx, sy + k * 12) for k in (-2, 2, -3, 3, -4, 4) for sx, sy in spots[:4]]
        tx, ty = next(((sx, sy) for sx, sy in spots if free((sx, sy, sx + tw, sy + 12))), spots[0])  # crowded: overprint
        placed.append((tx, ty, tx + tw, ty + 12))
        draw.text((tx, ty), lab, fill=colour, font=font)
    draw.text((left + pw / 2 - 3 * len(x_label), top + ph + 28), x_label, fill="black", font=font)
    draw.text((8, top - 24), y_label, fill="black", font=font)
    if title:
        draw.text((left + pw / 2 - 3 * len(title), 8), title, fill="black", font=font)
    if bad:
        draw.text((left, height - 22), "not plotted (no value): " + ", ".join(bad), fill="#aa0000", font=font)
    save_png_atomic(img, os.fspath(path))
