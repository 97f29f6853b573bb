"""EAGLE-3 drafter (Li et al. 2025, "Scaling up Inference Acceleration of Large Language
Models via Training-Time Test"), for any :class:`~specimg.models.eagle.EagleTarget`.

What differs from EAGLE-1, and why:

- features: the inputs of a low, a middle and a high target layer side by side (EAGLE-3's
  layers 2, n/2 and n - 3, clamped for shallow targets), fused by ``fc`` (3D -> D, no
  bias): the last layer alone is tuned to the next token, earlier ones keep more of what
  comes after it;
- its state is its own, not a guess of the target's last hidden state: there is no feature
  regression, and it has its own final norm and LM head (over the full VQ codebook; the
  paper's reduced draft vocabulary buys little for codebooks of a few thousand codes).
  The token embedding stays the target's, shared and frozen;
- its decoder layer's attention reads the normed token embedding and the normed state side
  by side (2D wide); the residual stream carries the state alone;
- training-time test (:meth:`Eagle3Drafter.forward_train`): it is trained on its own
  unrolled predictions, as it drafts (deeper tree levels feed it its own output states).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from specimg.models.base import exposed_layers
from specimg.models.eagle import EagleTarget, TreeDrafter, per_row
from specimg.models.llamagen import Attention, FeedForward, GPTConfig, KVSlot, RMSNorm


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers (the inputs of layers 2, n // 2 and n - 3),
    clamped to the target's and in order, for shallow targets."""
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))


class Eagle3Layer(nn.Module):
    """One decoder layer over (token embedding e, state h): h + attention(norm e | norm h),
    then a SwiGLU feed-forward block, both residual on h."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.embed_norm = RMSNorm(config.dim, config.norm_eps)
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, in_dim=2 * config.dim)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self, e: Tensor, h: Tensor, rope: Tensor, mask: Tensor | None, cache: KVSlot | None = None, start: int | Tensor = 0,
        past: list[tuple[Tensor, Tensor]] | None = None,
    ) -> Tensor:
        """With ``past`` (training-time test) the queries also see the keys and values of the
        earlier unrolled steps, kept in that list in step order; this step's are appended."""
        x = torch.cat([self.embed_norm(e), self.hidden_norm(h)], dim=-1)
        if past is None:
            h = h + self.attention(x, rope, mask, cache, start)
        else:
            q, k, v = self.attention.project(x, rope)
            past.append((k, v))
            h = h + self.attention.attend(q, torch.cat([k for k, _ in past], dim=2), torch.cat([v for _, v in past], dim=2), mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Eagle3Drafter(TreeDrafter):
    """EAGLE-3 over the target's ``feature_layers`` (default :func:`eagle3_layers`); building
    one asks the target to expose them (``expose_layers``)."""

    kind = "eagle3"

    def __init__(self, target: EagleTarget, max_tree_nodes: int = 128, feature_layers: Sequence[int] | None = None) -> None:
        super().__init__(target, max_tree_nodes)
        c = self.layer_config
        layers = eagle3_layers(target.num_layers) if feature_layers is None else feature_layers
        self.feature_layers = exposed_layers(layers, target.num_layers)
        target.expose_layers(self.feature_layers)
        self.fc = nn.Linear(len(self.feature_layers) * c.dim, c.dim, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.head = nn.Linear(c.dim, target.vocab_size, bias=False)

    def settings(self) -> dict[str, Any]:
        return {"feature_layers": list(self.feature_layers)}

    def _lift(self, hidden: Tensor) -> Tensor:
        return self.fc(hidden)

    def _forward(self, states: Tensor, tokens: Tensor, rope: Tensor, mask: Tensor | None, start: int | Tensor) -> Tensor:
        e = per_row(self.target.embed_codes(tokens.to(states.device)), states.shape[0])
        for layer, cache in zip(self.layers, self._kv):
            states = layer(e, states, rope, mask, cache, start)
        return states

    def _logits(self, h: Tensor) -> Tensor:
        return self.head(self.norm(h))

    def forward_train(self, layers: Tensor, tokens: Tensor, steps: int) -> list[Tensor]:
        """Training-time test: logits [B, T, V] of each of ``steps`` unrolled steps, from the
        target's fused layers [B, T, kD] before tokens [B, T] (``forward_sequence``'s
        convention).

        Entry j of step i is the drafter at tree depth i below a root at position j: it
        consumes token j + i at position j + i, its input state is step i - 1's output at
        entry j (the target's fused layers at step 0), and it predicts token j + i + 1 (entries
        j >= T - i have no token to consume and are garbage).  Its queries see what the
        drafter's cache holds at that node: the step-0 keys of positions <= j (the committed
        prefix up to the root) and the keys of entry j at steps 1 .. i (its ancestors and
        itself): a causal block, then one diagonal per step, as EAGLE-3's TTT mask.  So step
        i's logits equal the logits ``expand`` gives a chain of i nodes below root j."""
        t = tokens.shape[1]
        rope = self.target.draft_rope()
        index = torch.arange(t, device=layers.device)
        causal = index[None, :] <= index[:, None]
        diagonal = index[None, :] == index[:, None]
        h = self._lift(layers)
        past: list[tuple[Tensor, Tensor]] = []
        out = []
        for i in range(steps):
            shifted = (index + i).clamp(max=t - 1)
            e = self.target.embed_codes(tokens[:, shifted]).to(h.dtype)
            mask = torch.cat([causal] + [diagonal] * i, dim=1)
            h = self.layers[0](e, h, rope[(index + i).clamp(max=rope.shape[0] - 1)], mask, past=past)
            out.append(self._logits(h).float())
        return out
