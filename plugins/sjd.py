"""sjd: Speculative Jacobi Decoding (Teng et al., 2024), draft-free.

The target drafts for itself.  A window of L tokens follows the accepted prefix; each
step feeds the window to the target as a chain (one forward, causal), which gives p at
every window position, and walks it left to right:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    at the first rejection, emit a draw of norm(max(0, p_i - q_i)) and stop
    (the whole window accepted: emit a draw of the last node's p, the bonus token)

q_i is the distribution x_i was drawn from, so this is speculative sampling and exact.
The next window is drawn, as its drafts, from this step's p at the positions that were
not emitted (computed under the then-prefix, so q = that p), and topped up to L with
tokens drawn uniformly (q = 1/V).  The tree is a sampled chain that carries q as its
draft distributions; the core's recursive rejection on a one-child-per-node tree is the
rule above, and at temperature 0 the core's greedy walk reproduces AR's tokens.

``mode="paper"`` follows the released code (tyshiwo1/Accelerating-T2I-AR-with-SJD): the
window of L counts the committed token (L - 1 drafts), and a freshly drawn token x is
given a one-hot q, so it is accepted with probability p(x) and a rejection draws from
norm(max(0, p - onehot(x))).  That is still exact: it spends no TVD.

``ar_tail`` is the release's ``jacobi_loop_interval``: Jacobi windows stop that many
tokens before the image's end (no draft lands there) and the last tokens are decoded AR,
one per step.  test_llamagen.py sets ``jacobi_loop_interval_r = (target_size // 16)**2 -
max_num_new_tokens - 2``: the last 18 of LlamaGen's tokens (``mode="paper"``'s 18);
test_lumina_mgpt.py (and GSD's release) ``(target_size // 16)**2 + target_size // 16 -
10``, the last 10 of Lumina-mGPT's sequence with its end-of-line tokens (sjd beside gsd:
10).  The window also shrinks as it nears that point, as the release's ``min(16, r -
cur_len)`` does.  Exact either way: it trades speed only.

``init="repeat_horizon"`` is the released code's prior of that name (scheduler/
jacobi_iteration_lumina_mgpt.py:516-594, ``get_multi_token_for_preparation``): every new
position starts as the last token before the new ones (the last carried draft, else the
committed token), with a one-hot q, since it was not drawn.  The release computes each new
position's source as the position just left of it ("horizon"), clamped to the tokens it
already has, so all of a window's new positions copy that one token; it skips one slot per
row of W + 1, which on Lumina-mGPT is the end-of-line token (specimg's token grids have
none).  Exact too: q is what each draft came from.  Its LlamaGen script selects the scheme
but never applies it (``img_width`` comes from ``logits_processor[0].w_latent_dim``, which
LlamaGen's top-k warper lacks, so the branch is skipped): the released LlamaGen runs draw
new positions at random, and so ``mode="paper"`` keeps ``init="random"``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from attrs import validators as v

from specimg import DraftTree, MethodSpec, Sampling, Step, hookimpl


@attrs.frozen
class SJDOptions:
    """window: L, the draft tokens after the accepted prefix (each step's chain); in
    mode "paper" L counts the committed token, as the released code's 16 does.  init: how
    new positions start, "random" (uniform) or "repeat_horizon" (the release's prior: a copy
    of the last token before them).  ar_tail: the image's last tokens decoded AR (the
    release's jacobi_loop_interval: 18 on LlamaGen, 10 on Lumina-mGPT; 0: none)."""

    window: int = attrs.field(default=16, validator=v.ge(1))
    mode: str = attrs.field(default="specimg", validator=v.in_(("specimg", "paper")))
    init: str = attrs.field(default="random", validator=v.in_(("random", "repeat_horizon")))
    ar_tail: int = attrs.field(default=0, validator=v.ge(0))

    @property
    def drafts(self) -> int:
        """The drafts a window verifies (the released code's window includes the committed token)."""
        return self.window - 1 if self.mode == "paper" else self.window


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "sjd", SJDOptions, "SJD: draft-free speculative Jacobi decoding over a window of L tokens", drafter=False,
        paper={"mode": "paper", "ar_tail": 18},  # init random: the release's LlamaGen script names repeat_horizon but never applies it
        stacked_defaults={"gsd": {"mode": "paper", "ar_tail": 10}},  # GSD's released code runs on SJD's Lumina-mGPT one (init random)
        departures=(
            "fresh tokens are drawn uniformly and keep that q (the release gives them a one-hot q), L counts drafts, and Jacobi runs "
            "to the image's end (the release decodes the last 18 of LlamaGen's tokens AR); all exact"
        ),
    ))


@hookimpl
def propose_tree(
    root_token: int, max_depth: int, previous: Step, sampling: Sampling, generator: torch.Generator, options: SJDOptions,
) -> DraftTree:
    length = max(0, min(options.drafts, max_depth - options.ar_tail))  # no draft in the AR tail
    return jacobi_window(previous, root_token, length, generator, sampling.greedy, one_hot_fresh=options.mode == "paper",
                         repeat=options.init == "repeat_horizon")


def window_drafts(previous: Step, length: int) -> tuple[torch.Tensor, int]:
    """q [length, V] for the next window: the previous step's p at the nodes past its walk
    (its chain's nodes hold ids equal to their depths), then uniform rows; and how many
    rows were carried."""
    probs = previous.scores.probs
    carried = probs[len(previous.acceptance.path) : len(previous.acceptance.path) + length]
    fresh = torch.full((length - carried.shape[0], probs.shape[-1]), 1.0 / probs.shape[-1], device=probs.device)
    return torch.cat([carried, fresh]), carried.shape[0]


def jacobi_window(
    previous: Step, root_token: int, length: int, generator: torch.Generator, greedy: bool, one_hot_fresh: bool = False,
    repeat: bool = False,
) -> DraftTree:
    """The chain root -> x_1 -> ... -> x_length with x_i ~ q_i (argmax q_i when greedy);
    with ``one_hot_fresh`` the uniform rows then become one-hot at their draws (paper mode);
    with ``repeat`` (init="repeat_horizon") new positions copy the last token before them,
    one-hot."""
    device = previous.scores.probs.device
    q, carried = window_drafts(previous, length)
    if length == 0:
        drafts = torch.empty(0, dtype=torch.long, device=device)
    elif greedy:
        drafts = q.argmax(dim=-1)
    else:
        drafts = torch.multinomial(q, 1, generator=generator).squeeze(1)
    one_hot = torch.zeros(length, dtype=torch.bool, device=device)
    if one_hot_fresh:
        one_hot[carried:] = True
    if repeat:
        drafts, repeated = repeat_horizon(drafts, carried, root_token)
        one_hot |= repeated
    if one_hot_fresh or repeat:  # the default window keeps every row's q as drawn
        q = torch.where(one_hot[:, None], torch.nn.functional.one_hot(drafts, q.shape[-1]).to(q.dtype), q)
    tokens = torch.cat([torch.tensor([root_token], device=device), drafts])
    depths = torch.arange(length + 1, device=device)
    draft_probs = torch.cat([q, torch.zeros(1, q.shape[-1], device=device)])  # row u: what u's child was drawn from
    logprobs = torch.cat([torch.zeros(1, device=device), q.gather(1, drafts[:, None]).squeeze(1).log()])
    return DraftTree.from_tensors(tokens, depths - 1, depths, logprobs, draft_probs, sampled=True, width=1 if length else 0, height=length)


def repeat_horizon(drafts: torch.Tensor, carried: int, root_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts with each new one (index >= ``carried``) replaced by the last token before
    the new ones: the last carried draft, else ``root_token`` (the committed token); and
    which were replaced.  The release's source for new position j is j - 1 clamped to the
    tokens it holds (``last_flatten_indices.clamp(max=last_input_tokens.shape[1] - 1)``),
    so every new position copies that one token."""
    drafts, repeated = drafts.clone(), torch.zeros(drafts.shape[0], dtype=torch.bool, device=drafts.device)
    if carried < drafts.shape[0]:
        drafts[carried:] = drafts[carried - 1] if carried > 0 else root_token
        repeated[carried:] = True
    return drafts, repeated
