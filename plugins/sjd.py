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

``init="repeat_horizon"`` is the spatial prior of the released LlamaGen scripts: a new
position starts as the token one grid row above it (from the image so far or from this
window's drafts), with a one-hot q, since it was not drawn; positions of the first row are
drawn as with ``init="random"``.  Exact too: q is what each draft came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import torch
from attrs import validators as v

from specimg import DraftTree, MethodSpec, Sampling, SpecimgError, Step, Target, hookimpl


@attrs.frozen
class SJDOptions:
    """window: L, the draft tokens after the accepted prefix (each step's chain); in
    mode "paper" L counts the committed token, as the released code's 16 does.  init: how
    new positions start, "random" (uniform) or "repeat_horizon" (the token a row above)."""

    window: int = attrs.field(default=16, validator=v.ge(1))
    mode: str = attrs.field(default="specimg", validator=v.in_(("specimg", "paper")))
    init: str = attrs.field(default="random", validator=v.in_(("random", "repeat_horizon")))

    @property
    def drafts(self) -> int:
        """The drafts a window verifies (the released code's window includes the committed token)."""
        return self.window - 1 if self.mode == "paper" else self.window


@hookimpl
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    register(MethodSpec(
        "sjd", SJDOptions, "SJD: draft-free speculative Jacobi decoding over a window of L tokens", drafter=False,
        paper={"mode": "paper", "init": "repeat_horizon"},
        stacked_defaults={"gsd": {"mode": "paper"}},  # GSD's released code runs on SJD's (whose Lumina-mGPT init is random)
        departures=(
            "fresh tokens are drawn uniformly and keep that q (the release gives them a one-hot q and, in its LlamaGen scripts, "
            "starts them from the row above; its Lumina-mGPT scripts draw them at random: -o sjd.init=random), and L counts drafts; all exact"
        ),
    ))


@hookimpl
def propose_tree(
    root_token: int, max_depth: int, previous: Step, image_tokens: Sequence[int], target: Target, sampling: Sampling,
    generator: torch.Generator, options: SJDOptions,
) -> DraftTree:
    length = min(options.drafts, max_depth)
    width = grid_width(target.num_tokens) if options.init == "repeat_horizon" else 0
    return jacobi_window(previous, root_token, length, generator, sampling.greedy, one_hot_fresh=options.mode == "paper",
                         above=(image_tokens, width) if width else None)


def grid_width(num_tokens: int) -> int:
    """The width of a square token grid; repeat_horizon needs one."""
    width = math.isqrt(num_tokens)
    if width * width != num_tokens:
        raise SpecimgError(f"sjd.init=repeat_horizon reads the row above on a square token grid; this target has {num_tokens} tokens: use sjd.init=random")
    return width


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
    above: tuple[Sequence[int], int] | None = None,
) -> DraftTree:
    """The chain root -> x_1 -> ... -> x_length with x_i ~ q_i (argmax q_i when greedy);
    with ``one_hot_fresh`` the uniform rows then become one-hot at their draws (paper mode);
    with ``above`` (the image's tokens, the grid width) new positions below the first row
    repeat the token above them."""
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
    if above is not None:
        drafts, repeated = repeat_horizon(drafts, carried, *above)
        one_hot |= repeated
    if one_hot_fresh or above is not None:  # the default window keeps every row's q as drawn
        q = torch.where(one_hot[:, None], torch.nn.functional.one_hot(drafts, q.shape[-1]).to(q.dtype), q)
    tokens = torch.cat([torch.tensor([root_token], device=device), drafts])
    depths = torch.arange(length + 1, device=device)
    draft_probs = torch.cat([q, torch.zeros(1, q.shape[-1], device=device)])  # row u: what u's child was drawn from
    logprobs = torch.cat([torch.zeros(1, device=device), q.gather(1, drafts[:, None]).squeeze(1).log()])
    return DraftTree.from_tensors(tokens, depths - 1, depths, logprobs, draft_probs, sampled=True, width=1 if length else 0, height=length)


def repeat_horizon(drafts: torch.Tensor, carried: int, image: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts with each new one (index >= ``carried``) below the first row replaced by
    the token ``width`` positions before it, and which were replaced.  drafts[i] sits at
    image index len(image) + i."""
    drafts, repeated = drafts.clone(), torch.zeros(drafts.shape[0], dtype=torch.bool, device=drafts.device)
    known = torch.tensor(list(image[-width:]), dtype=drafts.dtype, device=drafts.device)  # image indices len(image) - len(known) ...
    for i in range(carried, drafts.shape[0]):
        source = len(image) + i - width
        if source < 0:
            continue
        back = source - len(image)  # < 0: a token of the image; else an earlier draft of this window
        drafts[i] = known[back] if back < 0 else drafts[back]
        repeated[i] = True
    return drafts, repeated
