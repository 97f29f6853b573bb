"""Logits to probabilities the way LlamaGen samples (CFG, temperature, top-k, top-p), and
tokens drawn from them as ``torch.multinomial`` draws them.

Everything is float32.  Greedy decoding (temperature 0) still needs a distribution for the
relaxations to work on: it is the temperature-1 distribution after the same filters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specimg.config import Sampling


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask logits outside top-k, then outside the top-p nucleus (LlamaGen's order and
    tie rule: keep every token at least as likely as the k-th; always keep the best)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.kthvalue(logits, logits.shape[-1] - top_k + 1, dim=-1, keepdim=True).values
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum > top_p
        drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: Tensor, sampling: Sampling, cfg_active: Tensor | bool = True) -> Tensor:
    """Processed next-token distributions [*n, V] from raw row logits [rows, *n, V].  With
    two rows, row 0 is conditional and row 1 unconditional; guidance applies where
    ``cfg_active`` ([*n] bool, or one bool) holds, elsewhere the conditional row is used."""
    logits = logits.float()
    guided = logits[0]
    if logits.shape[0] > 1 and sampling.cfg and cfg_active is not False:
        mixed = logits[1] + (guided - logits[1]) * sampling.cfg_scale
        guided = mixed if cfg_active is True else torch.where(cfg_active[..., None], mixed, guided)
    if sampling.temperature not in (0.0, 1.0):  # x / 1 is x: no kernel for it
        guided = guided / sampling.temperature
    return filter_logits(guided, sampling.top_k, sampling.top_p).softmax(dim=-1)


def cfg_active_at(token_index: Tensor | int, sampling: Sampling, offset: Tensor | int = 0) -> Tensor | bool:
    """Where guidance applies to nodes predicting image tokens ``token_index + offset``
    ([n], or one index: the AR loops' per-step flag, without a tensor per step); True
    alone where guidance never stops (no mask to build and apply, no index to add up).

    LlamaGen's decode loop turns guidance off once its step counter (token index - 1)
    passes cfg_interval; the first token, from the prefill, is always guided.
    """
    if sampling.cfg_interval < 0:
        return True
    return token_index + offset - 1 <= sampling.cfg_interval


def draw_rows(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row of ``probs`` [B, V]: [B], row i drawn as ``torch.multinomial(probs[i],
    1)`` draws it with ``generators[i]`` (one Exp(1) variate per token from the generator, the
    argmax of probs / variate: the same draws, the same generator state), without its checks of
    the distribution (GPU kernels; ``probs`` is a softmax's), one division and argmax for all rows."""
    variates = torch.empty_like(probs)
    for row, generator in zip(variates, generators, strict=True):
        row.exponential_(generator=generator)
    return (probs / variates).argmax(dim=-1)
