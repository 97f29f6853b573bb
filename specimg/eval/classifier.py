"""A small CNN classifier for the demo data: accuracy on the requested class, and the
feature space of the demo's Fréchet distance (docs/usage.md)."""

from __future__ import annotations

import json
import os

import torch
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.files import atomic_path

_METADATA_KEY = "specimg.classifier"


class DemoClassifier(nn.Module):
    """Images [B,3,H,W] in [-1,1] -> class logits; ``features`` is the pooled 128-d (by
    default) penultimate layer.  Four stages of (stride-2 conv, conv), BatchNorm + SiLU."""

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.num_classes, self.width = num_classes, width
        chans = [3, width, 2 * width, 4 * width, 4 * width]
        layers: list[nn.Module] = []
        for i in range(4):
            c = chans[i + 1]
            layers += [nn.Conv2d(chans[i], c, 3, stride=2, padding=1), nn.BatchNorm2d(c), nn.SiLU(),
                       nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.SiLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(chans[-1], num_classes)

    def features(self, images: Tensor) -> Tensor:
        """[B, feature_dim] pooled features."""
        w = self.head.weight
        h = self.body(images.to(device=w.device, dtype=w.dtype))
        return h.mean(dim=(2, 3))

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))

    @torch.no_grad()
    def predict(self, images: Tensor, batch: int = 256) -> Tensor:
        """Predicted class ids [B]."""
        return torch.cat([self(images[i : i + batch]).argmax(-1) for i in range(0, images.shape[0], batch)]) if len(images) else torch.zeros(0, dtype=torch.long)

    @torch.no_grad()
    def all_features(self, images: Tensor, batch: int = 256) -> Tensor:
        return torch.cat([self.features(images[i : i + batch]).float() for i in range(0, images.shape[0], batch)])


def save_classifier(model: DemoClassifier, path: str | os.PathLike[str]) -> None:
    from safetensors.torch import save_file

    path = os.fspath(path)
    meta = json.dumps({"num_classes": model.num_classes, "width": model.width})
    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, tmp, metadata={_METADATA_KEY: meta})


def load_classifier(path: str | os.PathLike[str]) -> DemoClassifier:
    from safetensors import safe_open

    from specimg.models.checkpoint import load_into, read_checkpoint

    path = os.fspath(path)
    state = read_checkpoint(path).state
    with safe_open(path, framework="pt") as f:
        meta = (f.metadata() or {}).get(_METADATA_KEY)
    if meta is None:
        raise SpecimgError(f"{path} is not a specimg demo classifier (no {_METADATA_KEY} header)")
    model = DemoClassifier(**json.loads(meta))
    load_into(model, {k: v.float() for k, v in state.items()}, origin=path)
    return model.eval()
