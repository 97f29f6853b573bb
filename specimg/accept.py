"""Exact acceptance over a draft tree (the exactness contract: docs/architecture.md).

Every rule here emits, at each node it reaches, a sample of that node's distribution q:
the accepted child's token or the correction token.  With q = p that is exact
speculative sampling; with a relaxed q the output follows q.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specimg.step import Acceptance
from specimg.tree import DraftTree


def _walk(tree: DraftTree, choose: Callable[[int], int]) -> Acceptance:
    """From the root, descend to the child whose token is ``choose(node)``; emit the first
    choice that is no child.  The candidates cross to the host once per step."""
    tokens, ids = (t.tolist() for t in tree.candidates())
    path, node = [0], 0
    while True:
        choice = choose(node)
        if choice not in tokens[node]:
            return Acceptance(path, choice)
        node = ids[node][tokens[node].index(choice)]
        path.append(node)


def sample_and_match(tree: DraftTree, dist: Tensor, generator: torch.Generator | None) -> Acceptance:
    """Draw y_u ~ dist[u] at each node the walk reaches; descend while y_u is a child.

    Exact for any tree built from draft-side information: each draw is fresh and
    independent of the tree.  Only the nodes on the path are drawn, in path order, so the
    draws are those of AR decoding with the same generator (and cheap for wide trees):
    one host round trip per accepted token.
    """
    return _walk(tree, lambda node: int(torch.multinomial(dist[node], 1, generator=generator)))


def greedy(tree: DraftTree, dist: Tensor) -> Acceptance:
    """Temperature 0: each node's token is argmax of its distribution (one host copy)."""
    choices = dist.argmax(dim=-1).tolist()
    return _walk(tree, choices.__getitem__)


def recursive_rejection(tree: DraftTree, target_dist: Tensor, generator: torch.Generator | None) -> Acceptance:
    """SpecInfer / Sequoia multi-draft rejection for trees whose children were drawn
    without replacement from the drafter's distribution at their parent.

    Sibling x_j is accepted with min(1, r(x_j) / q_j(x_j)); on rejection the residual
    becomes r <- norm(max(r - q_j, 0)) and q drops x_j.  Exact for a fixed target p.
    """
    if tree.draft_probs is None:
        raise ValueError("recursive rejection needs the draft distributions of a sampled tree")
    tokens, children = tree.tokens.tolist(), tree.children
    path, node = [0], 0
    while True:
        residual, draft = target_dist[node].double(), tree.draft_probs[node].double()
        accepted = None
        for child in children[node]:
            x = tokens[child]
            if torch.rand((), generator=generator, dtype=torch.float64, device=residual.device) * draft[x] <= residual[x]:
                accepted = child
                break
            left = (residual - draft).clamp_(min=0)
            if left.sum() > 0:  # no mass left only through float rounding (r == q), where rejecting had probability ~0
                residual = left / left.sum()
            draft[x] = 0
            if draft.sum() <= 0:
                break
            draft /= draft.sum()
        if accepted is None:
            token = int(torch.multinomial(residual.float(), 1, generator=generator))
            return Acceptance(path, token)
        path.append(accepted)
        node = accepted
