"""The hooks a specimg method plugin can implement.

Implement any of them with ``@specimg.hookimpl`` on a module or object that is registered
through the ``specimg`` entry-point group.  Declare only the arguments you use: pluggy
passes each implementation the keyword arguments it names.  Implementations take no
default arguments.

The engine calls the hooks of the methods in a stack (``--method a+b``) in the order of the
method string, never in registration order.  Every hook that receives ``options`` gets the
attrs options instance of the method being called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from specimg.config import Sampling, TreeConfig
    from specimg.methods import MethodSpec
    from specimg.models.base import Target
    from specimg.step import Acceptance, Scores, Step
    from specimg.tree import DraftSession, DraftTree

hookspec = pluggy.HookspecMarker("specimg")
hookimpl = pluggy.HookimplMarker("specimg")


@hookspec
def register_methods(register: Callable[[MethodSpec], None]) -> None:
    """Declare the methods this plugin provides by calling ``register(MethodSpec(...))``.

    Called once per plugin when the plugin manager loads; the registrations of all plugins
    are collected.  A plugin registering a method name already taken is left out, named.
    """


@hookspec(firstresult=True)
def propose_tree(
    session: DraftSession | None,
    root_token: int,
    tree_config: TreeConfig,
    max_depth: int,
    previous: Step,
    image_tokens: Sequence[int],
    target: Target,
    sampling: Sampling,
    generator: torch.Generator,
    options: Any,
) -> DraftTree | None:
    """Grow this step's draft tree from the drafter's ``session``, rooted at ``root_token``
    and no deeper than ``max_depth``.

    ``previous`` is the image's last step (before the first, the prefill as a one-node
    step): what a drafter-free method (``MethodSpec(drafter=False)``, whose ``session`` is
    None) drafts from, with ``image_tokens``, the image's tokens so far (the root's is the
    last: a prior may copy from them), and ``target`` (its ``num_tokens``: the
    grid); ``sampling`` the run's sampling settings (greedy or not).

    ``tree_config`` is this step's shape: the user's, or with auto trees the EAGLE-2 tree
    the planner chose for this step (a method with its own tree may take its size).
    First result wins.  The core's default builds the tree ``tree_config`` describes.  At
    most one method of a stack may implement this hook: two that both supply a tree is an
    error naming both.
    """


@hookspec(firstresult=True)
def score(target: Target, tree: DraftTree, sampling: Sampling, token_index: int) -> Scores | None:
    """Verify ``tree`` with ONE target forward; ``token_index`` is the image-token index the
    root's children predict.

    First result wins; the core's default runs ``target.forward_tree`` and processes the
    logits with ``sampling``.  Wrap it (``@hookimpl(wrapper=True)``) to add outputs.
    """


@hookspec
def build_relaxed_dist(
    dist: Tensor,
    target_dist: Tensor,
    budget: Tensor,
    tree: DraftTree,
    scores: Scores,
    target: Target,
    tokenizer: Any,
    options: Any,
) -> Tensor | None:
    """Relax the per-node distributions ``dist`` [n, V] of ``tree`` toward its candidates.

    ``target_dist`` is the target's processed distribution p [n, V]; ``dist`` is what the
    methods before this one in the stack made of it (p itself for the first).  ``budget``
    [n] is the total-variation distance this method may still add per node.  Return a new
    [n, V] distribution, or None to pass.  Folded in method-string order; the core checks
    each result keeps the contract (a distribution, zero where p is zero, within budget).
    """


@hookspec(firstresult=True)
def accept(
    tree: DraftTree, dist: Tensor, scores: Scores, sampling: Sampling, generator: torch.Generator, exact: bool, target: Target,
    options: Any,
) -> Acceptance | None:
    """Walk ``tree`` with the relaxed per-node distributions ``dist`` [n, V] and return the
    accepted path and the next token.

    First result wins; at most one method of a stack may implement it.  ``exact`` is true
    when the stack's budget is 0 or no member relaxes, so no relaxation can change p on any draft (a rule
    chosen per draft, e.g. recursive rejection only where a relaxation happened to pass,
    would be exact only on average over drafts).  The core's default: greedy argmax at temperature 0;
    recursive rejection with the draft probabilities for sampled trees when exact;
    otherwise sample-and-match, exact for any tree and any q_R.
    """


@hookspec
def train_loss(
    soft_ce: Tensor, regression: Tensor, w_cls: float, w_reg: float, features: Tensor, tokens: Tensor, mask: Tensor, options: Any
) -> tuple[Tensor, Tensor] | None:
    """Reweight the parts of the drafter's per-position training loss, so that a method can
    weigh the cross-entropy and the feature regression differently (CASCADE boosts only the
    cross-entropy).

    ``soft_ce`` and ``regression`` [B, T] are the parts so far; the loss is ``w_cls *
    soft_ce + w_reg * regression`` (EAGLE's weights) before the masked mean.  ``features``
    [B, T, D] are the target's hidden states (``features[:, t]`` after consuming ``tokens[:,
    t]``, the state whose distribution entry t matches), ``mask`` [B, T] the valid positions.
    An EAGLE-3 drafter's parts come per unrolled step, [K, B, T] (``regression`` zero),
    with ``features`` [K, B, T, D], ``tokens`` and ``mask`` [K, B, T] aligned to them the
    same way (step i's entry t consumes token t + i; entries past the image are masked);
    the trainer weighs step i by 0.8^i after the hooks.  Return the new ``(soft_ce,
    regression)`` of the same shape, or None to pass; folded in method-string order.
    """
