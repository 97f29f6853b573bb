"""CLIP score for t2i samples, through torchmetrics' CLIPScore, with a CLIP model from a
local folder (the ``eval`` extra: torchmetrics and transformers; nothing is downloaded).

CLIP score = 100 * mean over samples of max(cos(image embedding, caption embedding), 0),
torchmetrics' definition.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from specimg.errors import SpecimgError
from specimg.eval.fid import to_uint8


def local_clip(path: str | os.PathLike[str]) -> Callable[[], tuple[Any, Any]]:
    """A loader of a Hugging Face CLIP model and processor saved in ``path``."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SpecimgError(f"--clip-model {path} is not a Hugging Face model folder (no config.json)")

    def load() -> tuple[Any, Any]:
        try:
            from transformers import CLIPModel, CLIPProcessor
        except ImportError:
            raise SpecimgError("CLIP score needs transformers: pip install 'specimg[eval]'") from None
        try:
            return CLIPModel.from_pretrained(path, local_files_only=True).eval(), CLIPProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise SpecimgError(f"cannot load a CLIP model from {path}: {err}") from None

    return load


class CLIPScorer:
    """CLIP score of image sets against their captions.  ``model``: a local folder, or a
    callable returning (model, processor) as torchmetrics accepts (tests pass stand-ins)."""

    def __init__(self, model: str | os.PathLike[str] | Callable[[], tuple[Any, Any]], batch_size: int = 32) -> None:
        try:
            from torchmetrics.multimodal.clip_score import CLIPScore
        except ImportError:
            raise SpecimgError("CLIP score needs torchmetrics: pip install 'specimg[eval]'") from None
        loader = model if callable(model) else local_clip(model)
        self.metric = CLIPScore(model_name_or_path=loader)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, images: Tensor, captions: Sequence[str]) -> float:
        """``images`` in [-1, 1] (or uint8) [N, 3, H, W], one caption each."""
        if images.shape[0] != len(captions):
            raise SpecimgError(f"{images.shape[0]} images for {len(captions)} captions")
        images = to_uint8(images)
        self.metric.reset()
        for s in range(0, images.shape[0], self.batch_size):
            self.metric.update(images[s : s + self.batch_size], list(captions[s : s + self.batch_size]))
        return float(self.metric.compute())
