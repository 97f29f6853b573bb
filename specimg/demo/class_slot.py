"""Initialise a LlamaGen c2i target so that one head per layer starts out reading the class.

LlamaGen gives the class slot an all-zero RoPE row, so its query and key are zero: every
position scores the class slot at exactly 0, whatever the weights.  At initialisation all
scores are near 0, so image position p reads the class with weight about 1/p, and the model
must first learn to push every image key below 0 (an attention sink) before the class can
reach the digit rows, which on 2 CPU cores takes most of the training budget.

The fix changes no weight shape, only the starting point: every image token embedding gets
a shared component u, and in head 0 of each layer the query and key weights read u into the
slowest RoPE pairs (last row and last column frequency, nearly position-independent) with
opposite signs.  Every image key then scores about ``-score`` against every image query, so
head 0 starts with most of its weight on the class slot; training is free to undo it.
"""

from __future__ import annotations

import torch

from specimg.models.llamagen import LlamaGenTarget


@torch.no_grad()
def init_class_reading_heads(target: LlamaGenTarget, score: float = 5.0, seed: int = 0) -> list[float]:
    """Apply the initialisation above in place; return :func:`class_slot_weight` of the result
    on random tokens (the calibration check)."""
    c = target.config
    if c.model_type != "c2i":
        raise ValueError("class-reading heads need a class-conditional (c2i) target")
    g = torch.Generator().manual_seed(seed)
    emb = target.tok_embeddings.weight
    u = torch.randn(c.dim, generator=g)
    u_hat = u / u.norm()
    emb += u_hat * emb.norm(dim=1).mean()
    half = c.head_dim // 2
    pairs = (half // 2 - 1, half - 1)  # slowest row and column frequency of LlamaGen's 2D RoPE
    q_rows = [2 * p for p in pairs]
    k_rows = [c.n_head * c.head_dim + 2 * p for p in pairs]
    labels = torch.arange(4) % c.num_classes
    tokens = torch.randint(0, c.vocab_size, (4, c.block_size), generator=g)
    for layer in target.layers:
        # the u component of this layer's normed input, with the layers below already set
        seen: list[torch.Tensor] = []
        hook = layer.attention_norm.register_forward_hook(lambda m, i, out: seen.append(out[:, 1:].float()))
        target.forward_sequence(labels, tokens)
        hook.remove()
        a = (seen[0] @ u_hat).mean().item()
        gamma = (score * c.head_dim**0.5 / (len(pairs) * a * a)) ** 0.5
        w = layer.attention.wqkv.weight
        w[q_rows] += gamma * u_hat.to(w.dtype)
        w[k_rows] -= gamma * u_hat.to(w.dtype)
    return class_slot_weight(target, labels, tokens)


@torch.no_grad()
def class_slot_weight(target: LlamaGenTarget, labels: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """Per layer, the largest mean attention weight any head puts on the class slot from
    the image positions: how directly the class reaches the image."""
    c = target.config
    weights: list[float] = []

    def record(attn: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        x = inputs[0]
        s = x.shape[1]
        q, k, _ = attn.project(x, target.rope[:s])
        k = k.repeat_interleave(c.n_head // attn.n_kv_head, dim=1)
        scores = q.float() @ k.float().transpose(-1, -2) / c.head_dim**0.5
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        weights.append(scores.softmax(-1)[:, :, 1:, 0].mean(dim=(0, 2)).max().item())

    hooks = [layer.attention.register_forward_hook(record) for layer in target.layers]
    try:
        target.forward_sequence(labels, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return weights
