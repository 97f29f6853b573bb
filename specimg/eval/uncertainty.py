"""How uncertain a target is where it samples.

Relaxed acceptance pays when the target spreads its probability over many near-identical
codes.  This measures that spread on images the target drew: the processed next-token
distribution (CFG, temperature, top-k/top-p) at every position, teacher-forced on the
sampled tokens, which is the distribution its AR loop drew each token from.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch import Tensor

from specimg.config import Sampling
from specimg.errors import SpecimgError
from specimg.sampling import cfg_active_at, probabilities

TOP1_BINS = 20
"""Histogram bins of the top-1 probability over [0, 1]."""
ENTROPY_BINS = 20
"""Histogram bins of the entropy over [0, ln V]."""


@attrs.frozen
class Uncertainty:
    """Per sampled position: the top-1 probability, the entropy (nats) and how many codes
    carry 90 % of the mass.  ``vocab_size`` bounds the entropy's histogram."""

    top1: Tensor
    entropy: Tensor
    codes_for_90: Tensor
    vocab_size: int

    def summary(self) -> dict[str, Any]:
        """Quantiles, the share of flat positions, and histograms, JSON-ready."""
        q = torch.tensor([0.1, 0.5, 0.9])
        top1_q = self.top1.quantile(q).tolist()
        log_v = math.log(self.vocab_size)
        return {
            "positions": int(self.top1.numel()),
            "top1_p10_median_p90": [round(x, 4) for x in top1_q],
            "share_top1_at_most_0.1": round((self.top1 <= 0.1).float().mean().item(), 4),
            "share_top1_below_0.05": round((self.top1 < 0.05).float().mean().item(), 4),
            "entropy_median_nats": round(self.entropy.median().item(), 3),
            "codes_for_90pct_median": int(self.codes_for_90.median().item()),
            "top1_histogram": torch.histc(self.top1, TOP1_BINS, 0.0, 1.0).long().tolist(),
            "entropy_histogram": torch.histc(self.entropy, ENTROPY_BINS, 0.0, log_v).long().tolist(),
            "entropy_histogram_max_nats": round(log_v, 4),
        }


@torch.no_grad()
def sampled_uncertainty(target: Any, classes: Tensor, tokens: Tensor, sampling: Sampling, batch: int = 16) -> Uncertainty:
    """The target's processed distributions at every position of ``tokens`` [B, T], images of
    class ids ``classes`` [B] drawn at ``sampling`` (class-conditional targets: the
    unconditional row of CFG is the null class)."""
    if target.config.model_type != "c2i":
        raise SpecimgError("sampled_uncertainty measures class-conditional targets")
    null = target.config.num_classes
    device = target.tok_embeddings.weight.device
    active = cfg_active_at(torch.arange(tokens.shape[1], device=device), sampling)
    top1, entropy, needed = [], [], []
    for i in range(0, tokens.shape[0], batch):
        rows_tokens = tokens[i : i + batch].to(device)
        cond = classes[i : i + batch].to(device)
        variants = [cond, torch.full_like(cond, null)] if sampling.cfg else [cond]
        logits = torch.stack([target.forward_sequence(c, rows_tokens).logits for c in variants]).flatten(1, 2)  # [rows, b * T, V]
        probs = probabilities(logits, sampling, active.repeat(cond.shape[0]) if isinstance(active, Tensor) else active)
        ranked = probs.sort(dim=-1, descending=True).values
        top1.append(ranked[:, 0])
        entropy.append(-(probs * probs.clamp_min(1e-30).log()).sum(-1))
        needed.append((ranked.cumsum(-1) < 0.9).sum(-1) + 1)
    return Uncertainty(torch.cat(top1).cpu(), torch.cat(entropy).cpu(), torch.cat(needed).cpu(), target.vocab_size)
