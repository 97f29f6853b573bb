"""Quality of a benchmark's samples, per method, next to its speed: :class:`Quality` scores
each method's samples (token grids, one per condition, the same conditions and seeds for
every method) with what is available, and the floors an ideal sampler would score at the
same sample counts (docs/usage.md, "What the numbers mean" and "Quality sources").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from specimg.config import Sampling
from specimg.engine import ar_tokens
from specimg.errors import SpecimgError
from specimg.eval.metrics import Frechet, class_accuracy, frechet_distance, token_log_likelihood
from specimg.models.base import BatchSteps, Condition
from specimg.runs.images import decode_images

LOWER_IS_BETTER = {"fid": True, "frechet_real": True, "frechet_ar": True, "loglik": False, "accuracy": False, "clip": False}
PRIMARY_ORDER = ("fid", "frechet_real", "frechet_ar", "loglik")
"""Which metric a plot shows: the first one every method has."""

DEMO_REAL_SEED = 7_000
"""Seed of the demo's real reference images (held-out digit instances, ``split="test"``)."""
AR_FLOOR_SEED = 900_000
"""Image i of the AR floor's second sample set draws with seed AR_FLOOR_SEED + i."""


class Quality:
    """Scores sample sets; see the module doc.  ``real_images``: a callable giving (lazily)
    real images [N, 3, H, W] in [-1, 1] for the classifier's Fréchet distance, given a count
    and a seed."""

    def __init__(
        self,
        target: Any,
        tokenizer: Any,
        sampling: Sampling,
        conditions: Sequence[Condition],
        *,
        classifier: Any = None,
        real_images: Callable[[int, int], Tensor] | None = None,
        num_real: int = 1000,
        fid: Any = None,
        clip: Any = None,
        captions: Sequence[str] | None = None,
    ) -> None:
        self.target, self.tokenizer, self.sampling = target, tokenizer, sampling
        self.conditions = list(conditions)
        self.classifier, self.real_images, self.num_real = classifier, real_images, num_real
        self.fid, self.clip, self.captions = fid, clip, captions
        self.loglik = hasattr(target, "forward_sequence")
        self.notes: list[str] = []
        self._real_features: Tensor | None = None

    def _real(self) -> Tensor | None:
        if self._real_features is None and self.real_images is not None and self.classifier is not None:
            try:
                self._real_features = self.classifier.all_features(self.real_images(self.num_real, DEMO_REAL_SEED))
            except SpecimgError as err:
                self.notes.append(f"no Fréchet distance to real images: {err}")
                self.real_images = None
        return self._real_features

    def evaluate(self, samples: Mapping[str, Tensor], baseline: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """``samples``: label -> tokens [N, T] (row i from condition i).  Returns per label a
        dict of metrics, and the floors."""
        labels = [c for c in self.conditions if isinstance(c, int)]
        classes = torch.tensor(labels) if len(labels) == len(self.conditions) else None
        images = {k: decode_images(self.tokenizer, v, 32) for k, v in samples.items()} if self.tokenizer is not None else {}
        feats = {k: self.classifier.all_features(v) for k, v in images.items()} if self.classifier is not None else {}
        real = self._real() if feats else None
        out: dict[str, dict[str, Any]] = {k: {} for k in samples}
        for key, tokens in samples.items():
            q = out[key]
            if self.loglik:
                ll = token_log_likelihood(self.target, self.conditions, tokens, self.sampling)
                q["loglik"], q["loglik_raw"] = float(ll.processed.mean()), float(ll.raw.mean())
            if key in feats:
                if classes is not None:
                    q["accuracy"] = class_accuracy(self.classifier.predict(images[key]), classes)
                if real is not None and tokens.shape[0] >= 2:
                    q["frechet_real"] = frechet_distance(feats[key], real)
                if baseline in feats and tokens.shape[0] >= 2:
                    n = tokens.shape[0]
                    q["frechet_ar"] = Frechet(0.0, n, n) if key == baseline else frechet_distance(feats[key], feats[baseline])
            if self.fid is not None and key in images and tokens.shape[0] >= 2:
                q["fid"] = self.fid(images[key])
            if self.clip is not None and key in images and self.captions is not None:
                q["clip"] = self.clip(images[key], self.captions)
        floors: dict[str, Any] = {}
        n = next(iter(samples.values())).shape[0] if samples else 0
        if real is not None and self.real_images is not None and n >= 2:
            floors["frechet_real"] = frechet_distance(self.classifier.all_features(self.real_images(n, DEMO_REAL_SEED + 1)), real)
        if baseline in feats and n >= 2 and isinstance(self.target, BatchSteps):
            again = ar_tokens(self.target, self.conditions, [AR_FLOOR_SEED + i for i in range(n)], self.sampling)
            floors["frechet_ar"] = frechet_distance(self.classifier.all_features(decode_images(self.tokenizer, again, 32)), feats[baseline])
        return out, floors


def primary_metric(quality: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The metric a speed/quality plot shows: the first of PRIMARY_ORDER every method has."""
    for name in PRIMARY_ORDER:
        if quality and all(name in q for q in quality.values()):
            return name
    return None
