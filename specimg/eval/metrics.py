"""Quality metrics reported next to speed: the Fréchet distance between two feature sets,
class accuracy, and the target's log-likelihood per token (what they mean: docs/usage.md).
Every Fréchet number carries its sample counts (:class:`Frechet`): with few samples the
estimate is biased upwards (a perfect sampler does not score 0), so two numbers are only
comparable at equal counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from specimg.config import Sampling
from specimg.errors import SpecimgError
from specimg.models.base import Caption, Condition
from specimg.sampling import cfg_active_at, probabilities


@attrs.frozen
class Frechet:
    """A Fréchet distance and the sample counts it was estimated from."""

    value: float
    n_a: int
    n_b: int

    def __float__(self) -> float:
        return self.value

    def as_dict(self) -> dict[str, float | int]:
        return {"value": self.value, "n_a": self.n_a, "n_b": self.n_b}


def frechet_distance(a: Tensor, b: Tensor) -> Frechet:
    """Fréchet distance between Gaussians fitted to feature sets ``a`` [N, D] and ``b`` [M, D]:

        |mu_a - mu_b|^2 + tr S_a + tr S_b - 2 tr sqrt(S_a S_b)

    (unbiased covariances, as FID uses).  The trace of the matrix square root is computed
    without a matrix square root when a set is smaller than the feature dimension: with
    centred data A, B, the eigenvalues of S_a S_b are the squared singular values of
    A B^T / sqrt((N-1)(M-1)), so tr sqrt(S_a S_b) is that matrix's nuclear norm.  That is
    exact and well conditioned for the rank-deficient covariances of small sample counts.
    Otherwise it uses the symmetric form tr sqrt(sqrt(S_a) S_b sqrt(S_a)) through eigh.
    Both in float64; tiny negative round-off is clamped to 0.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise SpecimgError(f"Fréchet distance needs two [N, D] feature sets of one D, got {tuple(a.shape)} and {tuple(b.shape)}")
    n, m = a.shape[0], b.shape[0]
    if n < 2 or m < 2:
        raise SpecimgError(f"Fréchet distance needs at least 2 samples per set, got {n} and {m}")
    x, y = a.detach().double().cpu(), b.detach().double().cpu()
    mu_x, mu_y = x.mean(0), y.mean(0)
    xc, yc = x - mu_x, y - mu_y
    tr_x = (xc * xc).sum() / (n - 1)
    tr_y = (yc * yc).sum() / (m - 1)
    if min(n, m) <= x.shape[1]:
        tr_sqrt = torch.linalg.svdvals(xc @ yc.T).sum() / math.sqrt((n - 1) * (m - 1))
    else:
        s_x, s_y = xc.T @ xc / (n - 1), yc.T @ yc / (m - 1)
        w, v = torch.linalg.eigh(s_x)
        root = (v * w.clamp_min(0).sqrt()) @ v.T
        tr_sqrt = torch.linalg.eigvalsh(root @ s_y @ root).clamp_min(0).sqrt().sum()
    value = float(((mu_x - mu_y) ** 2).sum() + tr_x + tr_y - 2 * tr_sqrt)
    return Frechet(max(value, 0.0), n, m)


def class_accuracy(predicted: Tensor, requested: Tensor | Sequence[int]) -> float:
    """Fraction of samples whose predicted class is the class they were generated for."""
    requested = torch.as_tensor(requested, dtype=torch.long)
    if predicted.shape != requested.shape:
        raise SpecimgError(f"{predicted.shape[0]} predictions for {requested.shape[0]} requested classes")
    if requested.numel() == 0:
        return float("nan")
    return float((predicted.cpu() == requested).float().mean())


@attrs.frozen
class LogLikelihood:
    """Per image, the mean log-probability (nats per token) of its tokens under the target:
    ``processed`` under the distribution the sampler draws from, ``raw`` under the
    conditional row's plain softmax."""

    processed: Tensor
    raw: Tensor


@torch.no_grad()
def token_log_likelihood(target: object, conditions: Sequence[Condition], tokens: Tensor, sampling: Sampling) -> LogLikelihood:
    """Teacher-forced mean log-likelihood per token of ``tokens`` [B, T] under ``target``:
    ``processed`` under the distribution AR decoding samples from at ``sampling`` (CFG with
    the null condition, CFG interval, temperature, top-k, top-p; at temperature 0 the
    temperature-1 distribution after top-k/top-p, as the relaxations use), ``raw`` under the
    conditional row's plain softmax (docs/usage.md, "Log-likelihood per token").  A token
    outside the processed support (possible only through round-off at a top-k/top-p edge)
    counts as log(1e-30).  Needs ``target.forward_sequence`` (LlamaGen targets)."""
    forward = getattr(target, "forward_sequence", None)
    if forward is None:
        raise SpecimgError(f"{type(target).__name__} cannot teacher-force sequences (no forward_sequence)")
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    b, t = tokens.shape
    if len(conditions) != b:
        raise SpecimgError(f"{len(conditions)} conditions for {b} token rows")
    vocab = int(target.vocab_size)  # type: ignore[attr-defined]
    batch_size = max(1, (1 << 26) // max(1, 2 * t * vocab))  # keep the logits of one batch (both rows) near 256 MB
    active = cfg_active_at(torch.arange(t), sampling)
    processed, raw = [], []
    for s in range(0, b, batch_size):
        conds, rows = list(conditions[s : s + batch_size]), tokens[s : s + batch_size]
        out = forward(_condition_batch(target, conds, cond=True), rows).logits.float().cpu()
        if sampling.cfg:
            uncond = forward(_condition_batch(target, conds, cond=False), rows).logits.float().cpu()
        for i in range(rows.shape[0]):
            x = rows[i][:, None]
            raw.append(out[i].log_softmax(-1).gather(-1, x).mean())
            logits = torch.stack([out[i], uncond[i]]) if sampling.cfg else out[i][None]
            p = probabilities(logits, sampling, active).gather(-1, x)
            processed.append(p.clamp_min(1e-30).log().mean())
    return LogLikelihood(torch.stack(processed) if processed else torch.zeros(0), torch.stack(raw) if raw else torch.zeros(0))


def _condition_batch(target: object, conditions: Sequence[Condition], cond: bool) -> Tensor | list[Caption]:
    """The conditional (or unconditional: the null class / the null caption) rows of a batch
    in ``forward_sequence``'s format."""
    config = getattr(target, "config", None)
    if all(isinstance(c, int) for c in conditions):
        num_classes = int(getattr(config, "num_classes", 0))
        return torch.tensor([c if cond else num_classes for c in conditions], dtype=torch.long)
    if all(isinstance(c, Caption) for c in conditions):
        if cond:
            return list(conditions)  # type: ignore[arg-type]
        null = target.cls_embedding.uncond_embedding  # type: ignore[attr-defined]
        return [Caption(null.to(c.features.dtype), c.mask) for c in conditions]  # type: ignore[union-attr]
    raise SpecimgError("conditions must be all class ids or all captions")
