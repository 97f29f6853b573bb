"""Offline class-conditional demo images: coloured handwritten digits over photo crops.

Everything comes from files that ship inside the scikit-learn and scikit-image wheels (no
download): scikit-learn's 1797 8x8 handwritten digits give the 10 classes; scikit-image's
bundled photos and textures give the backgrounds.  Each 64x64 RGB image in [-1, 1] is:

- a random crop (12-100% of the side, random flip) of one of the photos or tinted
  textures, resampled to 64x64, with its contrast lowered (x0.25-0.6) so that the digit
  stays the most salient thing; small crops give smooth regions, large ones texture;
- one digit of the requested class, upscaled bicubically to 52 px, rotated by up to
  +-5 degrees, centred, alpha-composited in a random colour that is light on dark
  backgrounds and dark on light ones.

The class signal is made easy to learn on purpose: a target trained on 2 CPU cores sees
under 100k sequences to learn how the class shapes the image.  Large centred digits put
the class into most of the 256 tokens, at the same places in every image, and the
training split draws from 20 handwritten instances per class (``GLYPHS_PER_CLASS``), so
the target learns 200 shapes under photo-like variety rather than all of handwriting.

A 4x-downsampling VQ turns one image into 16x16 = 256 tokens, like LlamaGen at 256px.
The split decides which digit instances are used: ``train`` draws from the first
``glyphs_per_class`` of each class among the first 1400 scikit-learn digits (all of them
with ``None``), ``test`` (held out) from the remaining 397.  Backgrounds are crops of
the same photos in both splits.  Output depends only on ``(n, seed, split,
glyphs_per_class)``.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specimg.errors import SpecimgError

Split = Literal["train", "test"]

NUM_CLASSES = 10
IMAGE_SIZE = 64
_SOURCE_SIZE = 192
_TRAIN_DIGITS = 1400
GLYPHS_PER_CLASS = 20
"""Handwritten instances per class in the default training split."""
_DIGIT_PX = 52
_ROTATION_DEG = 5.0
COLOUR_SOURCES = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")
"""Colour photos bundled with scikit-image."""
TEXTURE_SOURCES = ("brick", "grass", "gravel", "camera", "moon", "coins", "text")
"""Greyscale photos and textures bundled with scikit-image, tinted in a random colour."""

RECIPE = {
    "classes": f"scikit-learn load_digits (10 classes, 8x8, 1797 images; train = the first {GLYPHS_PER_CLASS} of each class among the first 1400, test = the last 397)",
    "backgrounds": {"colour": list(COLOUR_SOURCES), "tinted": list(TEXTURE_SOURCES), "crop_fraction": [0.12, 1.0], "contrast": [0.25, 0.6]},
    "digit": {"size_px": _DIGIT_PX, "rotation_deg": _ROTATION_DEG, "position": "centred", "colour": "random hue; light on dark, dark on light backgrounds"},
    "image": "64x64 RGB in [-1, 1]",
}


def _require(module: str) -> None:
    raise SpecimgError(f"the demo data needs {module}: pip install 'specimg[demo]'")


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[Tensor, Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        _require("scikit-learn")
    d = load_digits()
    return torch.from_numpy(d.images).float().div(16.0), torch.from_numpy(d.target).long()


@functools.lru_cache(maxsize=1)
def _sources() -> Tensor:
    """[S, 3, 192, 192] in [0, 1]: square centre crops of the bundled images, colour first."""
    try:
        import skimage.data
    except ImportError:
        _require("scikit-image")
    out = []
    for name in COLOUR_SOURCES + TEXTURE_SOURCES:
        img = np.asarray(getattr(skimage.data, name)())
        if img.dtype == bool:
            img = img.astype(np.uint8) * 255
        t = torch.from_numpy(img[..., :3] if img.ndim == 3 else img).float() / 255.0
        t = t.permute(2, 0, 1) if t.dim() == 3 else t[None].expand(3, -1, -1)
        side = min(t.shape[1:])
        top, left = (t.shape[1] - side) // 2, (t.shape[2] - side) // 2
        t = t[:, top : top + side, left : left + side]
        out.append(F.interpolate(t[None], size=(_SOURCE_SIZE, _SOURCE_SIZE), mode="area")[0])
    return torch.stack(out)


def real_images(num: int, seed: int) -> Tensor:
    """Held-out real demo images (the test split): the bench's reference for Fréchet
    distances on the demo, handed to ``specimg.eval.quality.Quality``."""
    return make_dataset(num, seed=seed, split="test")[0]


def make_dataset(
    n: int, seed: int = 0, split: Split = "train", chunk: int = 512, glyphs_per_class: int | None = GLYPHS_PER_CLASS
) -> tuple[Tensor, Tensor]:
    """``n`` images [n, 3, 64, 64] in [-1, 1] and labels [n]; classes balanced (label i % 10,
    shuffled), deterministic in ``(n, seed, split, glyphs_per_class)``."""
    if split not in ("train", "test"):
        raise SpecimgError(f"split must be 'train' or 'test', not {split!r}")
    if n < 0:
        raise SpecimgError("n must be >= 0")
    if glyphs_per_class is not None and glyphs_per_class < 1:
        raise SpecimgError("glyphs_per_class must be >= 1 (or None for every training digit)")
    digits, digit_labels = _digits()
    pool = torch.arange(_TRAIN_DIGITS) if split == "train" else torch.arange(_TRAIN_DIGITS, digits.shape[0])
    by_class = [pool[digit_labels[pool] == c] for c in range(NUM_CLASSES)]
    if split == "train" and glyphs_per_class is not None:
        by_class = [b[:glyphs_per_class] for b in by_class]
    sources = _sources()
    n_colour = len(COLOUR_SOURCES)
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    labels = torch.from_numpy(rng.permutation(np.arange(n) % NUM_CLASSES)).long()
    # every random draw up front, so chunking never changes the result
    pick = [by_class[int(c)][int(rng.integers(len(by_class[int(c)])))] for c in labels]
    src = rng.integers(len(sources), size=n)
    crop = rng.uniform(0.12, 1.0, size=n)
    cx, cy = (rng.uniform(-1, 1, size=n) * (1 - crop) for _ in range(2))
    flip = rng.choice([-1.0, 1.0], size=n)
    tint = rng.uniform(0.2, 1.0, size=(n, 3))
    contrast = rng.uniform(0.25, 0.6, size=n)
    angle = np.deg2rad(rng.uniform(-_ROTATION_DEG, _ROTATION_DEG, size=n))
    hue = rng.uniform(0.0, 1.0, size=(n, 3))
    images = torch.empty(n, 3, IMAGE_SIZE, IMAGE_SIZE)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        m = e - s
        sl = slice(s, e)
        # background: affine crop of the source
        theta = torch.zeros(m, 2, 3)
        theta[:, 0, 0] = torch.from_numpy(crop[sl] * flip[sl]).float()
        theta[:, 1, 1] = torch.from_numpy(crop[sl]).float()
        theta[:, 0, 2] = torch.from_numpy(cx[sl]).float()
        theta[:, 1, 2] = torch.from_numpy(cy[sl]).float()
        grid = F.affine_grid(theta, [m, 3, IMAGE_SIZE, IMAGE_SIZE], align_corners=False)
        bg = F.grid_sample(sources[torch.from_numpy(src[sl])], grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        is_texture = torch.from_numpy(src[sl] >= n_colour)
        bg = torch.where(is_texture[:, None, None, None], bg * torch.from_numpy(tint[sl]).float()[:, :, None, None], bg)
        mean = bg.mean(dim=(1, 2, 3), keepdim=True)
        bg = mean + (bg - mean) * torch.from_numpy(contrast[sl]).float()[:, None, None, None]
        # digit: 8x8 padded to 12x12, inverse affine from the 64x64 canvas
        glyph = F.pad(digits[torch.stack(pick[s:e])][:, None], (2, 2, 2, 2))
        k = (8.0 / 12.0) * IMAGE_SIZE / _DIGIT_PX
        cos, sin = torch.from_numpy(np.cos(angle[sl])).float(), torch.from_numpy(np.sin(angle[sl])).float()
        theta = torch.zeros(m, 2, 3)
        theta[:, 0, 0], theta[:, 0, 1] = k * cos, k * sin
        theta[:, 1, 0], theta[:, 1, 1] = -k * sin, k * cos
        grid = F.affine_grid(theta, [m, 1, IMAGE_SIZE, IMAGE_SIZE], align_corners=False)
        alpha = F.grid_sample(glyph, grid, mode="bicubic", padding_mode="zeros", align_corners=False)
        alpha = ((alpha - 0.2) * 2.5).clamp(0, 1)
        lum = bg.mean(dim=(1, 2, 3))
        colour = torch.from_numpy(hue[sl]).float()
        colour = torch.where((lum > 0.45)[:, None], colour * 0.3, 0.6 + colour * 0.4)[:, :, None, None]
        images[sl] = (bg * (1 - alpha) + colour * alpha) * 2 - 1
    return images.clamp_(-1, 1), labels
