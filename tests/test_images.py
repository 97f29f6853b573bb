"""Image helpers: conversion, labelled grids, atomic PNG writes."""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from specimg.runs.images import make_grid, make_table, save_png_atomic, to_pil


def test_to_pil_clamps_and_scales() -> None:
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0]).view(1, 1, 1, 5).expand(2, 3, 1, 5)
    imgs = to_pil(x)
    assert len(imgs) == 2 and imgs[0].size == (5, 1) and imgs[0].mode == "RGB"
    assert [imgs[0].getpixel((i, 0))[0] for i in range(5)] == [0, 0, 128, 255, 255]


def test_grid_size_without_labels() -> None:
    grid = make_grid(torch.zeros(5, 3, 8, 8), nrow=3)
    assert grid.size == (3 * 10 + 2, 2 * 10 + 2)
    assert grid.getpixel((2, 2)) == (128, 128, 128) and grid.getpixel((0, 0)) == (255, 255, 255)


def test_grid_label_strip_holds_text() -> None:
    tiles = torch.ones(2, 3, 32, 32)
    plain, labelled = make_grid(tiles, nrow=2), make_grid(tiles, nrow=2, labels=["cat", ""])
    strip = labelled.height - plain.height
    assert labelled.width == plain.width and strip > 4
    def dark(x0: int) -> int:
        box = labelled.crop((x0, 2 + 32, x0 + 32, labelled.height - 2)).convert("L")
        return sum(box.histogram()[:128])
    assert dark(2) > 0 and dark(36) == 0
    with pytest.raises(ValueError):
        make_grid(tiles, nrow=2, labels=["one"])


def test_a_table_names_its_rows_whole_and_heads_its_columns() -> None:
    """The bench's samples: a long method name is not cut, and every column has its class."""
    tiles = torch.ones(4, 3, 16, 16)  # white tiles: only the labels are dark
    table = make_table(tiles, ["ar", "cascade+lantern"], ["class 3", "class 7"])
    name = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength("cascade+lantern", font=ImageFont.load_default())
    margin = table.width - 2 * (16 + 2) - 2
    assert margin >= name  # the whole name fits left of the tiles

    def dark(box: tuple[int, int, int, int]) -> int:
        return sum(table.crop(box).convert("L").histogram()[:128])

    strip = table.height - 2 * (16 + 2) - 2
    assert all(dark((margin + c * 18, 0, margin + c * 18 + 16, strip)) > 0 for c in range(2))  # each column's heading
    assert dark((0, strip + 18, margin, table.height)) > dark((0, strip, margin, strip + 16)) > 0  # the longer name, below the shorter
    assert dark((margin, strip, table.width, table.height)) == 0  # the tiles themselves untouched
    with pytest.raises(ValueError):
        make_table(tiles, ["ar"], ["class 3", "class 7"])


def test_save_png_atomic_leaves_no_temp_file(tmp_path) -> None:
    img = Image.new("RGB", (4, 4), "red")
    target = tmp_path / "sub" / "a.png"
    save_png_atomic(img, target)
    assert os.listdir(target.parent) == ["a.png"]
    assert Image.open(target).getpixel((0, 0)) == (255, 0, 0)

    class Broken(Image.Image):
        def save(self, *args, **kwargs):
            raise OSError("disk full")

    with pytest.raises(OSError):
        save_png_atomic(Broken(), tmp_path / "sub" / "b.png")
    assert os.listdir(target.parent) == ["a.png"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_get_the_users_permissions(tmp_path, umask) -> None:
    """As ``open`` gives a new file, not mkstemp's private 0600 (a rewrite included)."""
    from specimg.models.loading import TINY_VQ
    from specimg.models.vq import build_tokenizer, save_tokenizer

    old = os.umask(umask)
    try:
        for _ in range(2):
            save_png_atomic(Image.new("RGB", (4, 4)), tmp_path / "a.png")
            save_tokenizer(build_tokenizer(**TINY_VQ), tmp_path / "vq.safetensors")
    finally:
        os.umask(old)
    for name in ("a.png", "vq.safetensors"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask
