"""A small CNN classifier for the demo data: accuracy on the requested class, and the
feature space of the demo's Fréchet distance (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os

import numpy as np
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


def frechet_distance(a: Tensor, b: Tensor) -> float:
    """Fréchet distance between Gaussians fitted to feature sets a [N, D] and b [M, D]
    (tr sqrt(S1 S2) through the symmetric form sqrt(S1) S2 sqrt(S1); numpy only)."""
    x, y = a.double().cpu().numpy(), b.double().cpu().numpy()
    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.atleast_2d(np.cov(x, rowvar=False)), np.atleast_2d(np.cov(y, rowvar=False))
    w, v = np.linalg.eigh(s1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh(root @ s2 @ root), 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)


def save_classifier(model: DemoClassifier, path: str | os.PathLike[str]) -> None:
    from safetensors.torch import save_file

    path = os.fspath(path)
    meta = json.dumps({"num_classes": model.num_classes, "width": model.width})
    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, tmp, metadata={_METADATA_KEY: meta})


def load_classifier(path: str | os.PathLike[str]) -> DemoClassifier:
    from safetensors import safe_open

    from specimg.models.checkpoint import load_into, load_state_dict

    path = os.fspath(path)
    state = load_state_dict(path)
    with safe_open(path, framework="pt") as f:
        meta = (f.metadata() or {}).get(_METADATA_KEY)
    if meta is None:
        raise SpecimgError(f"{path} is not a specimg demo classifier (no {_METADATA_KEY} header)")
    model = DemoClassifier(**json.loads(meta))
    load_into(model, {k: v.float() for k, v in state.items()}, origin=path)
    return model.eval()
