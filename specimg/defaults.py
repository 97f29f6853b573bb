"""The core's own implementations of the firstresult hooks propose_tree and score, used
when no method in the stack supplies one.  Registered first (``specimg.plugins``), but
marked ``trylast``, so pluggy calls them after any method's implementation.  (The core's
acceptance rule is the engine's own, run where the stack's ``accept`` passes, so that it
can take every tree of a batch at once: ``Engine.accept``.)"""

from __future__ import annotations

import torch

from specimg.config import Sampling, TreeConfig
from specimg.hookspecs import hookimpl
from specimg.models.base import Target
from specimg.step import Scores, scores_of
from specimg.tree import DraftSession, DraftTree, build_tree


@hookimpl(trylast=True)
def propose_tree(
    session: DraftSession, root_token: int, tree_config: TreeConfig, max_depth: int, generator: torch.Generator
) -> DraftTree:
    return build_tree(session, root_token, tree_config, max_depth, generator)


@hookimpl(trylast=True)
def score(target: Target, tree: DraftTree, sampling: Sampling, token_index: int) -> Scores:
    return scores_of(target.forward_tree(tree.tokens, tree.depths, tree.mask), tree.depths, sampling, token_index)
