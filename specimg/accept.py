"""Exact acceptance over a draft tree (the exactness contract: docs/architecture.md).

Every rule here emits, at each node it reaches, a sample of that node's distribution q:
the accepted child's token or the correction token.  With q = p that is exact
speculative sampling; with a relaxed q the output follows q.

Where a host read stalls the device (a GPU), sample-and-match and greedy walk the tree as a
device program (:func:`walk_forest`, one tree or a batch's): the host reads the outcome once and the commit
copies nothing back.  On the CPU, where reads are free, they walk on the host, which
draws only the nodes it reaches.  Both make the same draws from the same generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specimg import stalls
from specimg.config import Sampling
from specimg.step import Acceptance, Walked
from specimg.tree import DraftTree


def rejects_recursively(sampling: Sampling, exact: bool, tree: DraftTree) -> bool:
    """Whether the core's default rule is recursive rejection (a sampled tree, sampled
    tokens, an exact stack); otherwise it walks the tree (greedy or sample-and-match)."""
    return not sampling.greedy and exact and tree.sampled


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


def walk_forest(forest: DraftTree, roots: Sequence[int], dist: Tensor, generators: Sequence[torch.Generator] | None) -> list[Acceptance]:
    """Sample-and-match (with ``generators``, one per tree) or greedy (None) on every tree of
    a forest (:meth:`DraftTree.forest`, its roots at ``roots``; or one tree, root 0) as one
    device program of ``forest.height + 1`` levels, whatever the outcome: the host reads
    the outcome once for every tree (the generators' states are host-side copies on CUDA:
    no wait), and the levels after a walk stopped are ignored.

    Each level draws once per tree with that tree's generator, as
    ``torch.multinomial(row, 1)`` draws one token (an Exp(1) variate per entry from the
    generator, the argmax of row / variate: the same draws and the same generator state),
    and every tree's generator is then set back to its state after the draws that counted,
    as :func:`sample_and_match` does for one tree.  Paths and tokens come back per tree, in
    that tree's own node ids."""
    tokens, ids = forest.candidates()
    device, walkers = tokens.device, len(roots)
    start = stalls.on_device(list(roots), device)
    node, walking = start, torch.ones(walkers, dtype=torch.bool, device=device)
    variates = torch.empty(walkers, dist.shape[-1], dtype=dist.dtype, device=device)
    states: list[list[Tensor]] = [[g.get_state()] for g in generators] if generators is not None else []
    reached, chosen = [], []
    for _ in range(forest.height + 1):
        if generators is None:
            choice = dist[node].argmax(dim=-1)
        else:
            for row, generator, saved in zip(variates, generators, states):
                row.exponential_(generator=generator)
                saved.append(generator.get_state())
            choice = (dist[node] / variates).argmax(dim=-1)
        hit = (tokens[node] == choice[:, None]) & (ids[node] >= 0)  # [walkers, C]; a node's children have distinct tokens
        chosen.append(choice)
        walking = walking & hit.any(dim=1)
        node = torch.where(walking, (ids[node] * hit).sum(dim=1), node)
        reached.append(torch.where(walking, node, -1))
    levels, choices = torch.stack(reached), torch.stack(chosen)  # [levels, walkers]
    accepted = (levels >= 0).sum(dim=0)
    outcome = torch.cat([accepted, levels.T.flatten(), choices.T.flatten()]).tolist()  # the one host read
    depth, results = forest.height + 1, []
    for walker, root in enumerate(roots):
        count = outcome[walker]
        if generators is not None:
            generators[walker].set_state(states[walker][count + 1])
        at = walkers + walker * depth
        nodes = [reached_node - root for reached_node in outcome[at : at + count]]
        token_list = outcome[walkers * (1 + depth) + walker * depth :][: count + 1]
        path = torch.cat([start.new_zeros(1), levels[:count, walker] - root])
        results.append(Acceptance([0, *nodes], token_list[-1], Walked(path, choices[: count + 1, walker], token_list)))
    return results


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
    return walk_forest(tree, [0], dist, [generator])[0]


def greedy(tree: DraftTree, dist: Tensor) -> Acceptance:
    """Temperature 0: each node's token is argmax of its distribution (one host copy)."""
    choices = dist.argmax(dim=-1)
    if stalls.host_reads_stall(dist.device):
        return walk_forest(tree, [0], dist, None)[0]
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
