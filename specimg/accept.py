"""Exact acceptance over a draft tree (the exactness contract: docs/architecture.md).

Every rule here emits, at each node it reaches, a sample of that node's distribution q:
the accepted child's token or the correction token.  With q = p that is exact
speculative sampling; with a relaxed q the output follows q.

Where a host read stalls the device (a GPU), sample-and-match and greedy walk the tree as a
device program (:func:`_walk_on_device`): the host reads the outcome once and the commit
copies nothing back.  On the CPU, where reads are free, they walk on the host, which
draws only the nodes it reaches.  Both make the same draws from the same generator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specimg import stalls
from specimg.step import Acceptance, Walked
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


def _walk_on_device(tree: DraftTree, choose: Callable[[Tensor], Tensor], keep: Callable[[int], None] = lambda accepted: None) -> Acceptance:
    """:func:`_walk` as a device program of ``tree.height + 1`` levels, whatever the outcome:
    ``choose(node)`` ([1] node id -> [1] token) runs at every level, and once the walk has
    stopped its choices are ignored.  The host reads the outcome in one copy, then
    ``keep(accepted)`` learns how many levels counted."""
    tokens, ids = tree.candidates()
    node = torch.zeros(1, dtype=torch.long, device=tokens.device)
    walking = torch.ones(1, dtype=torch.bool, device=tokens.device)
    reached, chosen = [], []
    for _ in range(tree.height + 1):
        choice = choose(node)
        hit = (tokens[node] == choice[:, None]) & (ids[node] >= 0)  # [1, C]; a node's children have distinct tokens
        chosen.append(choice)  # while walking: the matched child's token, or at the stop the next token
        walking = walking & hit.any(dim=1)
        node = torch.where(walking, (ids[node] * hit).sum(dim=1), node)
        reached.append(torch.where(walking, node, -1))
    levels, choices = torch.cat(reached), torch.cat(chosen)
    accepted = (levels >= 0).sum(dim=0, keepdim=True)
    outcome = torch.cat([accepted, levels, choices]).tolist()  # the one host read
    count, depth = outcome[0], tree.height + 1
    keep(count)
    path = torch.cat([node.new_zeros(1), levels[:count]])
    token_list = outcome[1 + depth : 1 + depth + count + 1]
    return Acceptance([0, *outcome[1 : 1 + count]], token_list[-1], Walked(path, choices[: count + 1], token_list))


def sample_and_match(tree: DraftTree, dist: Tensor, generator: torch.Generator | None) -> Acceptance:
    """Draw y_u ~ dist[u] at each node the walk reaches; descend while y_u is a child.

    Exact for any tree built from draft-side information: each draw is fresh and
    independent of the tree.  The nodes on the path are drawn in path order, so the draws
    are those of AR decoding with the same generator.  On the host: one round trip per
    accepted token.  On a device (with a generator): one draw per level whatever the
    outcome, then the generator is set back to its state after the draws that counted.
    """
    if generator is None or not stalls.host_reads_stall(dist.device):
        return _walk(tree, lambda node: int(torch.multinomial(dist[node], 1, generator=generator)))
    states = [generator.get_state()]  # a host-side copy on CUDA (seed and offset): no wait

    def draw(node: Tensor) -> Tensor:
        choice = torch.multinomial(dist[node], 1, generator=generator).squeeze(1)
        states.append(generator.get_state())
        return choice

    return _walk_on_device(tree, draw, lambda accepted: generator.set_state(states[accepted + 1]))


def greedy(tree: DraftTree, dist: Tensor) -> Acceptance:
    """Temperature 0: each node's token is argmax of its distribution (one host copy)."""
    choices = dist.argmax(dim=-1)
    if stalls.host_reads_stall(dist.device):
        return _walk_on_device(tree, choices.__getitem__)
    return _walk(tree, choices.tolist().__getitem__)


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
