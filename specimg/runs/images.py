"""Image helpers: tensors in [-1, 1] to PIL, atomic PNG writes, labelled grids."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from specimg.files import atomic_path

_PAD = 2


def condition_label(key: Any) -> str:
    """A condition as an image's label names it: its class, or its prompt (text or token ids)."""
    if isinstance(key, str):
        return key
    if isinstance(key, tuple | list):
        return "ids " + " ".join(map(str, key))
    return f"class {key}"


def decode_images(tokenizer: Any, codes: Tensor, batch: int | None = None) -> Tensor:
    """Codes [N, T] -> float images [N, 3, H, W] in [-1, 1], decoded ``batch`` at a time (None: all at once)."""
    step = batch or max(1, codes.shape[0])
    with torch.inference_mode():
        return torch.cat([tokenizer.decode(codes[s : s + step]).float().clamp(-1, 1) for s in range(0, codes.shape[0], step)])


def to_pil(images: Tensor) -> list[Image.Image]:
    """[B,3,H,W] in [-1,1] -> RGB images (values clamped, rounded to uint8)."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [B,3,H,W], got {tuple(images.shape)}")
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return [Image.fromarray(p.permute(1, 2, 0).cpu().numpy(), "RGB") for p in pixels]


def save_png_atomic(img: Image.Image, path: str | os.PathLike[str]) -> None:
    """Write a PNG via a temporary file in the same directory and a rename, so a crash never
    leaves a truncated image where a finished one is expected."""
    with atomic_path(path, ".png") as tmp:
        img.save(tmp, format="PNG")


def make_grid(images: Tensor | Sequence[Image.Image], nrow: int, labels: Sequence[str] | None = None) -> Image.Image:
    """Tile images ``nrow`` per row on white, each with a caption strip underneath when
    ``labels`` are given (PIL's default font, cut to the tile width)."""
    tiles = to_pil(images) if isinstance(images, Tensor) else list(images)
    if not tiles or nrow < 1:
        raise ValueError("make_grid needs at least one image and nrow >= 1")
    if labels is not None and len(labels) != len(tiles):
        raise ValueError(f"{len(labels)} labels for {len(tiles)} images")
    w = max(t.width for t in tiles)
    h = max(t.height for t in tiles)
    font = ImageFont.load_default()
    strip = 0 if labels is None else int(font.getbbox("Ag")[3]) + 2 * _PAD
    cols, rows = min(nrow, len(tiles)), math.ceil(len(tiles) / nrow)
    grid = Image.new("RGB", (cols * (w + _PAD) + _PAD, rows * (h + strip + _PAD) + _PAD), "white")
    draw = ImageDraw.Draw(grid)
    for i, tile in enumerate(tiles):
        x = _PAD + (i % nrow) * (w + _PAD)
        y = _PAD + (i // nrow) * (h + strip + _PAD)
        grid.paste(tile.convert("RGB"), (x, y))
        if labels is not None:
            text = labels[i]
            while text and draw.textlength(text, font=font) > w:
                text = text[:-1]
            draw.text((x, y + h + _PAD), text, fill="black", font=font)
    return grid


def make_table(images: Tensor | Sequence[Image.Image], row_labels: Sequence[str], column_labels: Sequence[str]) -> Image.Image:
    """Images as a table, row after row: each row's label whole in a margin on the left (as
    wide as the longest), each column's above it (cut to the tile width)."""
    tiles = to_pil(images) if isinstance(images, Tensor) else list(images)
    rows, cols = len(row_labels), len(column_labels)
    if not tiles or len(tiles) != rows * cols:
        raise ValueError(f"{len(tiles)} images for {rows} rows of {cols} columns")
    w, h = max(t.width for t in tiles), max(t.height for t in tiles)
    font = ImageFont.load_default()
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    margin = int(max(draw.textlength(label, font=font) for label in row_labels)) + 3 * _PAD
    strip = int(font.getbbox("Ag")[3]) + 2 * _PAD
    grid = Image.new("RGB", (margin + cols * (w + _PAD) + _PAD, strip + rows * (h + _PAD) + _PAD), "white")
    draw = ImageDraw.Draw(grid)
    for c, label in enumerate(column_labels):
        while label and draw.textlength(label, font=font) > w:
            label = label[:-1]
        draw.text((margin + c * (w + _PAD), _PAD), label, fill="black", font=font)
    for r, label in enumerate(row_labels):
        y = strip + r * (h + _PAD)
        draw.text((_PAD, y + (h - strip) // 2), label, fill="black", font=font)
        for c in range(cols):
            grid.paste(tiles[r * cols + c].convert("RGB"), (margin + c * (w + _PAD), y))
    return grid
