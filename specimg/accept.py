"""Exact acceptance over a draft tree (the exactness contract: docs/architecture.md).

Every rule here emits, at each node it reaches, a sample of that node's distribution q:
the accepted child's token or the correction token.  With q = p that is exact
speculative sampling; with a relaxed q the output follows q.

Every rule takes one tree or a batch's forest (:func:`accept_forest`).  Where a host read
stalls the device (a GPU), the walk is a device program: the host reads the outcome once
and the commit copies nothing back.  On the CPU, where reads are free, the rules walk on
the host, drawing only what they use.  Sample-and-match and greedy make the same draws
in both forms; recursive rejection's device form draws a level's worth whatever happens
in it, so only its law is the host form's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specimg import stalls
from specimg.config import Sampling
from specimg.step import Acceptance, Walked
from specimg.tree import DraftTree


Level = Callable[[Tensor], tuple[Tensor, Tensor]]
"""One level of a device walk: each walker's node (-1 once it stopped) -> its emitted token
and the child it descends to (-1: it stops; always -1 from node -1)."""


def rejects_recursively(sampling: Sampling, exact: bool, tree: DraftTree) -> bool:
    """Whether the core's default rule is recursive rejection (a sampled tree, sampled
    tokens, an exact stack); otherwise it walks the tree (greedy or sample-and-match)."""
    return not sampling.greedy and exact and tree.sampled


def walk_forest(forest: DraftTree, roots: Sequence[int], dist: Tensor, generators: Sequence[torch.Generator | None] | None) -> list[Acceptance]:
    """Sample-and-match (with ``generators``, one per tree) or greedy (None) on every tree
    of a forest (:meth:`DraftTree.forest`, its roots at ``roots``; or one tree, root 0).

    Where a host read stalls, one device program for every tree (:func:`_walk_on_device`);
    else on the host, each tree drawing only at the nodes its walk reaches, the candidates
    read once for all.  Both make the same draws and leave each generator as drawing alone
    would.  Paths and tokens come back per tree, in that tree's own node ids, with their
    device tensors (``walked``) made in one copy."""
    if not stalls.host_reads_stall(dist.device) or (generators is not None and None in generators):
        return _walk_on_host(forest, roots, dist, generators)
    return _walk_on_device(forest, roots, generators, _matching(forest, dist, generators))  # type: ignore[arg-type]


def _walk_on_host(forest: DraftTree, roots: Sequence[int], dist: Tensor, generators: Sequence[torch.Generator | None] | None) -> list[Acceptance]:
    """Each tree's walk on the host: descend to the child whose token is the node's draw
    (greedy: its argmax); emit the first draw that is no child."""
    tokens, ids = (t.tolist() for t in forest.candidates())
    best = dist.argmax(dim=-1).tolist() if generators is None else []
    walks = []
    for walker, root in enumerate(roots):
        path, node = [root], root
        while True:
            choice = best[node] if generators is None else int(torch.multinomial(dist[node], 1, generator=generators[walker]))
            if choice not in tokens[node]:
                break
            node = ids[node][tokens[node].index(choice)]
            path.append(node)
        walks.append((path, choice))
    return _copied(forest, walks)


def _copied(forest: DraftTree, walks: Sequence[tuple[list[int], int]]) -> list[Acceptance]:
    """The acceptances of walks made on the host (each path in forest ids from its root,
    and its next token), with every path's device tensors (``walked``) made in one copy."""
    node_tokens = forest.tokens.tolist()
    new_tokens = [[node_tokens[node] for node in path[1:]] + [choice] for path, choice in walks]
    paths = [[node - path[0] for node in path] for path, _ in walks]
    parts = stalls.on_device([value for path, new in zip(paths, new_tokens) for value in (*path, *new)], forest.tokens.device).split(
        [length for path in paths for length in (len(path), len(path))])
    return [Acceptance(path, new[-1], Walked(parts[2 * i], parts[2 * i + 1], new)) for i, (path, new) in enumerate(zip(paths, new_tokens))]


def _walk_on_device(forest: DraftTree, roots: Sequence[int], generators: Sequence[torch.Generator] | None, level: Level) -> list[Acceptance]:
    """Every tree's walk as one device program of ``forest.height + 1`` levels, whatever
    the outcome: ``level(node)`` gives each walker's emitted token at its node and the
    child it descends to (-1: it stops there), drawing from each walker's generator.
    The host reads the outcome once for every tree (the generators' states are host-side
    copies on CUDA: no wait), the levels after a walk stopped are ignored, and every
    tree's generator is set back to its state after the draws that counted."""
    device, walkers = forest.tokens.device, len(roots)
    start = stalls.on_device(list(roots), device)
    node = start
    states: list[list[Tensor]] = [[g.get_state()] for g in generators] if generators is not None else []
    reached, chosen = [], []
    for _ in range(forest.height + 1):
        choice, node = level(node)  # a stopped walker's node is -1 from then on
        for generator, saved in zip(generators or (), states):
            saved.append(generator.get_state())
        chosen.append(choice)
        reached.append(node)
    levels, choices = torch.stack(reached), torch.stack(chosen)  # [levels, walkers]
    accepted = (levels >= 0).sum(dim=0)
    outcome = torch.cat([accepted, levels.T.flatten(), choices.T.flatten()]).tolist()  # the one host read
    depth, results = forest.height + 1, []
    paths = torch.cat([start.new_zeros(walkers, 1), levels.T - start[:, None]], dim=1)  # each walker's path from its root, in its tree's ids
    for walker, root in enumerate(roots):
        count = outcome[walker]
        if generators is not None:
            generators[walker].set_state(states[walker][count + 1])
        at = walkers + walker * depth
        nodes = [reached_node - root for reached_node in outcome[at : at + count]]
        token_list = outcome[walkers * (1 + depth) + walker * depth :][: count + 1]
        results.append(Acceptance([0, *nodes], token_list[-1], Walked(paths[walker, : count + 1], choices[: count + 1, walker], token_list)))
    return results


def _matching(forest: DraftTree, dist: Tensor, generators: Sequence[torch.Generator] | None) -> Level:
    """Sample-and-match's level (greedy without ``generators``): each walker draws once
    from its node's distribution, as ``torch.multinomial(row, 1)`` draws one token (an
    Exp(1) variate per entry from the generator, the argmax of row / variate: the same
    draws and the same generator state), and descends to the child with that token.

    Each node's child with each token sits in one table [n + 2, V] (-1: none; int32, 4 (n
    + 2) V bytes: 8 MB for 128 nodes of 16384 tokens), one lookup a level: a root is
    nobody's child, so its entry goes to row n, which no walker reads; the last row has
    no children, and node -1 reads it: a stopped walker finds no child, unasked."""
    n, vocab = forest.size, dist.shape[-1]
    child_of = torch.full((n + 2, vocab), -1, dtype=torch.int32, device=dist.device)
    child_of[torch.where(forest.parents >= 0, forest.parents, n), forest.tokens] = torch.arange(n, dtype=torch.int32, device=dist.device)  # siblings' tokens are distinct
    variates = torch.empty(len(generators or ()), vocab, dtype=dist.dtype, device=dist.device)

    def level(node: Tensor) -> tuple[Tensor, Tensor]:
        if generators is None:
            choice = dist[node].argmax(dim=-1)
        else:
            for row, generator in zip(variates, generators):
                row.exponential_(generator=generator)
            choice = (dist[node] / variates).argmax(dim=-1)
        return choice, child_of[node, choice]

    return level


def _rejecting(forest: DraftTree, target_dist: Tensor, generators: Sequence[torch.Generator]) -> Level:
    """Recursive rejection's level (:func:`recursive_rejection`) for every walker at once:
    C uniforms and V Exp(1) variates per walker and level, used or not, so that a level
    draws as much whatever happens in it; the children in draft-rank order, a rejected
    one's draft mass taken from the residual; after the last, a draw from the residual
    (the argmax of residual / variate, as ``torch.multinomial``)."""
    assert forest.draft_probs is not None
    tokens, ids = forest.candidates()
    walkers, vocab = len(generators), target_dist.shape[-1]
    uniforms = torch.empty(walkers, ids.shape[1], dtype=torch.float64, device=target_dist.device)
    variates = torch.empty(walkers, vocab, dtype=torch.float32, device=target_dist.device)

    def level(node: Tensor) -> tuple[Tensor, Tensor]:
        for u, e, generator in zip(uniforms, variates, generators):
            u.uniform_(generator=generator)
            e.exponential_(generator=generator)
        residual, draft = target_dist[node].double(), forest.draft_probs[node].double()  # node -1: rows never taken
        child, trying = torch.full_like(node, -1), node >= 0
        for column in range(ids.shape[1]):
            candidate, x = ids[node, column], tokens[node, column].clamp(min=0)[:, None]
            trying = trying & (candidate >= 0)
            take = trying & (uniforms[:, column] * draft.gather(1, x)[:, 0] <= residual.gather(1, x)[:, 0])
            child = torch.where(take, candidate, child)
            rejected = (trying & ~take)[:, None]
            left = (residual - draft).clamp(min=0)
            mass = left.sum(dim=1, keepdim=True)
            residual = torch.where(rejected & (mass > 0), left / mass.clamp(min=torch.finfo(torch.float64).tiny), residual)
            draft = torch.where(rejected, draft.scatter(1, x, 0.0), draft)
            total = draft.sum(dim=1, keepdim=True)
            draft = torch.where(rejected & (total > 0), draft / total.clamp(min=torch.finfo(torch.float64).tiny), draft)
            trying = trying & ~take & (total[:, 0] > 0)  # no draft mass left: no child can be drawn
        correction = (residual.float() / variates).argmax(dim=-1)
        return torch.where(child >= 0, forest.tokens[child.clamp(min=0)], correction), child

    return level


def _thresholding(chain: DraftTree, accept_prob: Tensor, residual: Tensor, generators: Sequence[torch.Generator]) -> Level:
    """:func:`chain_acceptance`'s level for every walker at once: one uniform and V Exp(1)
    variates per walker and level, used or not; the child is taken where the uniform falls
    below its node's probability, else the residual's draw (the argmax of residual /
    variate, as ``torch.multinomial``) is emitted."""
    tokens, ids = chain.candidates()
    uniforms = torch.empty(len(generators), 1, dtype=torch.float64, device=residual.device)
    variates = torch.empty(len(generators), residual.shape[-1], dtype=torch.float32, device=residual.device)

    def level(node: Tensor) -> tuple[Tensor, Tensor]:
        for u, e, generator in zip(uniforms, variates, generators):
            u.uniform_(generator=generator)
            e.exponential_(generator=generator)
        child = torch.where(node >= 0, ids[node, 0], -1)
        take = (uniforms[:, 0] < accept_prob[node].double()) & (child >= 0)
        drawn = (residual[node].float() / variates).argmax(dim=-1)
        return torch.where(take, tokens[node, 0], drawn), torch.where(take, child, -1)

    return level


def chain_acceptance(chain: DraftTree, accept_prob: Tensor, residual: Tensor, generator: torch.Generator) -> Acceptance:
    """A chain of drafts whose node i accepts its child with probability ``accept_prob[i]``,
    independently of the other nodes, and where the walk stops emits a draw from
    ``residual[i]`` (weights [n, V]; at the last node, its bonus distribution).  GSD's
    group test is such a rule.

    On the host every node's uniform is drawn at once, then the residual's draw.  Where a
    host read stalls, one device program (:func:`_walk_on_device`: a uniform and V
    variates a level), with the same law and one read."""
    if chain.child_ids.shape[1] > 1:
        raise ValueError("chain_acceptance takes a chain: every node has at most one child")
    if stalls.host_reads_stall(residual.device):
        return _walk_on_device(chain, [0], [generator], _thresholding(chain, accept_prob, residual, [generator]))[0]
    uniforms = torch.rand(accept_prob.shape, generator=generator, dtype=torch.float64, device=residual.device)
    accepted = (uniforms < accept_prob.double()).tolist()
    path, node, next_ids = [0], 0, chain.child_ids[:, 0].tolist()
    while next_ids[node] >= 0 and accepted[node]:
        node = next_ids[node]
        path.append(node)
    return Acceptance(path, int(torch.multinomial(residual[node].float(), 1, generator=generator)))


def sample_and_match(tree: DraftTree, dist: Tensor, generator: torch.Generator | None) -> Acceptance:
    """Draw y_u ~ dist[u] at each node the walk reaches; descend while y_u is a child.

    Exact for any tree built from draft-side information: each draw is fresh and
    independent of the tree.  The nodes on the path are drawn in path order, so the draws
    are those of AR decoding with the same generator (:func:`walk_forest`: on the host one
    round trip per accepted token; on a device one draw per level whatever the outcome,
    the generator then set back to its state after the draws that counted)."""
    return walk_forest(tree, [0], dist, [generator])[0]


def greedy(tree: DraftTree, dist: Tensor) -> Acceptance:
    """Temperature 0: each node's token is argmax of its distribution (:func:`walk_forest`)."""
    return walk_forest(tree, [0], dist, None)[0]


def recursive_rejection(tree: DraftTree, target_dist: Tensor, generator: torch.Generator | None) -> Acceptance:
    """SpecInfer / Sequoia multi-draft rejection for trees whose children were drawn
    without replacement from the drafter's distribution at their parent.

    Sibling x_j is accepted with min(1, r(x_j) / q_j(x_j)); on rejection the residual
    becomes r <- norm(max(r - q_j, 0)) and q drops x_j.  Exact for a fixed target p.
    (:func:`reject_forest` for one tree.)
    """
    return reject_forest(tree, [0], target_dist, [generator])[0]


def reject_forest(forest: DraftTree, roots: Sequence[int], target_dist: Tensor, generators: Sequence[torch.Generator | None]) -> list[Acceptance]:
    """:func:`recursive_rejection` on every tree of a forest (its roots at ``roots``; or one
    tree, root 0), tree g drawing from ``generators[g]``.

    On the host each tree draws only what it uses (:func:`_reject_on_host`).  Where a host
    read stalls, one device program for every tree (:func:`_rejecting`): a level draws the
    same whatever happens in it, so its draws are not the host's, but its law is the
    same.  Paths and tokens come back per tree, in that tree's own node ids, with their
    device tensors (``walked``)."""
    if forest.draft_probs is None:
        raise ValueError("recursive rejection needs the draft distributions of a sampled tree")
    if stalls.host_reads_stall(target_dist.device) and None not in generators:
        return _walk_on_device(forest, roots, generators, _rejecting(forest, target_dist, generators))  # type: ignore[arg-type]
    trees, dists = ([forest], [target_dist]) if forest.images is None else (forest.trees(), target_dist.split(list(forest.sizes)))
    results = [_reject_on_host(tree, dist, generator) for tree, dist, generator in zip(trees, dists, generators)]
    return _copied(forest, [([root + node for node in result.path], result.next_token) for root, result in zip(roots, results)])


def accept_forest(
    forest: DraftTree, roots: Sequence[int], dist: Tensor, target_dist: Tensor, sampling: Sampling, exact: bool,
    generators: Sequence[torch.Generator | None],
) -> list[Acceptance]:
    """The core's rule on every tree of a forest (or one tree, root 0): recursive rejection
    against ``target_dist`` where it applies (:func:`rejects_recursively`), else
    sample-and-match on ``dist`` (greedy at temperature 0)."""
    if rejects_recursively(sampling, exact, forest):
        return reject_forest(forest, roots, target_dist, generators)
    return walk_forest(forest, roots, dist, None if sampling.greedy else generators)


def _reject_on_host(tree: DraftTree, target_dist: Tensor, generator: torch.Generator | None) -> Acceptance:
    """One tree's recursive rejection on the host, drawing only what it uses: a uniform per
    child it tries, and the residual's draw where it rejects them all."""
    assert tree.draft_probs is not None
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
