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

import itertools
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specimg import relax, stalls
from specimg.config import Sampling
from specimg.compiled import run
from specimg.step import Acceptance, Walked
from specimg.tree import DraftTree


Level = Callable[[Tensor, Sequence[Tensor]], tuple[Tensor, Tensor]]
"""One level of a device walk: each walker's node (-1 once it stopped) and its draws for
the level ([walkers, size] per kind of draw) -> its emitted token and the child it
descends to (-1: it stops; always -1 from node -1)."""


def walk_forest(
    forest: DraftTree, roots: Sequence[int], dist: Tensor, generators: Sequence[torch.Generator | None] | None, compiled: bool = False,
    target_dist: Tensor | None = None,
) -> list[Acceptance]:
    """Sample-and-match (with ``generators``, one per tree) or greedy (None) on every tree
    of a forest (:meth:`DraftTree.forest`, its roots at ``roots``; or one tree, root 0):
    draw y_u ~ dist[u] (greedy: its argmax) at each node the walk reaches, descend while
    y_u is a child.  Exact for any tree built from draft-side information, since each draw
    is fresh and independent of the tree; drawn in path order, so the draws are those of
    AR decoding with the same generator.

    Where a host read stalls, one device program for every tree (:func:`_walk_on_device`),
    compiled where ``compiled``; with ``target_dist``, p where ``dist`` is a relaxed
    q_R, it also measures the budget each path spent (``Walked.spent``).  Else on the host,
    each tree drawing only at the nodes its walk reaches, the candidates read once for
    all.  Both make the same draws and leave each generator as drawing alone would.  Paths
    and tokens come back per tree, in that tree's own node ids, with their device tensors
    (``walked``) made in one copy."""
    if not stalls.host_reads_stall(dist.device) or (generators is not None and None in generators):
        return _walk_on_host(forest, roots, dist, generators)
    spent = None if target_dist is None or target_dist is dist else (dist, target_dist)
    draws = (("exponential_", dist.shape[-1], dist.dtype),) if generators is not None else ()
    tensors = (dist, forest.parents, forest.tokens)
    return _walk_on_device(forest, roots, generators, _match_levels, tensors, draws, compiled, spent)  # type: ignore[arg-type]


def _walk_on_host(forest: DraftTree, roots: Sequence[int], dist: Tensor, generators: Sequence[torch.Generator | None] | None) -> list[Acceptance]:
    """Each tree's walk on the host: descend to the child whose token is the node's draw
    (greedy: its argmax); emit the first draw that is no child.  Every draw is emitted,
    so a walk's new tokens are its draws."""
    tokens, ids = [t.tolist() for t in forest.candidates()]
    best = dist.argmax(dim=-1).tolist() if generators is None else []
    paths, news = [], []
    for walker, root in enumerate(roots):
        path, drawn, node = [0], [], root
        while True:
            choice = best[node] if generators is None else int(torch.multinomial(dist[node], 1, generator=generators[walker]))
            drawn.append(choice)
            if choice not in tokens[node]:
                break
            node = ids[node][tokens[node].index(choice)]
            path.append(node - root)
        paths.append(path)
        news.append(drawn)
    return _copied(paths, news, forest.tokens.device)


def _copied(paths: Sequence[list[int]], news: Sequence[list[int]], device: torch.device) -> list[Acceptance]:
    """The acceptances of walks made on the host (each its path in its tree's ids, root 0,
    and its new tokens: the path's after the root, then the next token), with every walk's
    device tensors (``walked``) made in one copy (the lists joined without a Python loop)."""
    parts = stalls.on_device(list(itertools.chain.from_iterable(map(operator.add, paths, news))), device).split_with_sizes(
        list(itertools.chain.from_iterable(zip(map(len, paths), map(len, news)))))
    return [Acceptance(path, new[-1], Walked(path_there, new_there, new)) for path, new, path_there, new_there in zip(paths, news, parts[::2], parts[1::2])]


def _walk_on_device(
    forest: DraftTree, roots: Sequence[int], generators: Sequence[torch.Generator] | None, levels: Callable[..., Level], tensors: tuple[Tensor, ...],
    draws: Sequence[tuple[str, int, torch.dtype]], compiled: bool = False, spent: tuple[Tensor, Tensor] | None = None,
) -> list[Acceptance]:
    """Every tree's walk as one device program of ``forest.height + 1`` levels, whatever
    the outcome, of a rule's level function, which ``levels`` makes from the step's
    ``tensors`` alone (a rule keeps no tensor of its own, so its program compiles once per
    shape and runs on any step's tensors); ``draws``: what each walker draws at every
    level (per kind, in drawing order, the ``Tensor`` method that draws it in place, its
    size and dtype).  Each walker's draws for every level are made first, from its own
    generator (:func:`_draw`); the program of levels then takes them as it takes the
    step's tensors, so that it compiles as one program per shape where ``compiled`` (the
    generators stay outside it).  The host reads the outcome once for every tree (the
    generators' states are host-side copies on CUDA: no wait), the levels after a walk
    stopped are ignored, and every tree's generator is set back to its state after the
    draws that counted.  With ``spent`` (q_R and p), the program also sums each path's
    TVD of q_R to p (``Walked.spent``)."""
    device, walkers, depth = forest.tokens.device, len(roots), forest.height + 1
    start = stalls.on_device(list(roots), device)
    drawn, states = _draw(draws, generators or (), depth, device)
    inputs = [start, *tensors, *drawn, *(spent or ())]
    packed, *measured = run(_levels, levels, len(tensors), len(drawn), depth, *inputs, compiled=compiled)
    outcome = packed.tolist()  # the one host read
    results = []
    for walker, saved in enumerate(states or [None] * walkers):
        count = outcome[walker]
        if saved is not None:
            generators[walker].set_state(saved[count + 1])  # type: ignore[index]
        tokens = slice(walkers + walker * depth, walkers + walker * depth + count + 1)
        path = slice(walkers * (1 + depth) + walker * (depth + 1), walkers * (1 + depth) + walker * (depth + 1) + count + 1)
        token_list = outcome[tokens]
        walked = Walked(packed[path], packed[tokens], token_list, measured[0][walker] if measured else None)
        results.append(Acceptance(outcome[path], token_list[-1], walked))
    return results


def _draw(
    draws: Sequence[tuple[str, int, torch.dtype]], generators: Sequence[torch.Generator], depth: int, device: torch.device
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """Each walker's draws for ``depth`` levels ([depth, walkers, size] per kind), level by
    level from its own generator, as its walk would draw them where every level counted;
    and each generator's state before the first level and after each."""
    buffers = [torch.empty(depth, len(generators), size, dtype=dtype, device=device) for _, size, dtype in draws]
    states = [[generator.get_state()] for generator in generators]
    for level in range(depth):
        for walker, (generator, saved) in enumerate(zip(generators, states)):
            for (method, _, _), buffer in zip(draws, buffers):
                getattr(buffer[level, walker], method)(generator=generator)
            saved.append(generator.get_state())
    return buffers, states


def _levels(levels: Callable[..., Level], count: int, kinds: int, depth: int, start: Tensor, *inputs: Tensor) -> list[Tensor]:
    """A device walk's program: ``depth`` levels of the level ``levels`` makes from the
    step's ``count`` tensors, from the walkers' roots ``start``, each level taking its
    draws from the next ``kinds`` of ``inputs``.  Its outcome in one tensor: each walker's
    count of accepted nodes, then its emitted tokens per level, then its path in its
    tree's ids (root 0, one node per level; a level after its walk stopped holds junk).
    Where q_R and p close ``inputs``, each walker's TVD of one to the other summed over
    its path follows, in a second tensor."""
    level, draws, spent = levels(*inputs[:count]), inputs[count : count + kinds], inputs[count + kinds :]
    node, reached, chosen = start, [], []
    for step in range(depth):
        choice, node = level(node, [drawn[step] for drawn in draws])  # a stopped walker's node is -1 from then on
        chosen.append(choice)
        reached.append(node)
    nodes, choices = torch.stack(reached, dim=1), torch.stack(chosen, dim=1)  # [walkers, depth]
    paths = torch.cat([torch.zeros_like(start)[:, None], nodes - start[:, None]], dim=1)
    outcome = [torch.cat([(nodes >= 0).sum(dim=1), choices.flatten(), paths.flatten()])]
    if spent:
        on_path = torch.cat([start[:, None], nodes], dim=1)
        outcome.append((relax.tvd(*spent)[on_path.clamp(min=0)] * (on_path >= 0)).sum(dim=1))
    return outcome


def _match_levels(dist: Tensor, parents: Tensor, tokens: Tensor) -> Level:
    """Sample-and-match (greedy without draws): each walker draws once from its node's
    distribution as ``torch.multinomial(row, 1)`` draws one token (the argmax of row / an
    Exp(1) variate per entry: the same draws, the same generator state), and descends to
    the child with that token.  Each node's child with each token sits in one table [n +
    2, V] (-1: none; int32), one lookup a level: a root is nobody's child, so its entry
    goes to row n, which no walker reads; the last row has no children, and node -1 reads
    it: a stopped walker finds no child, unasked."""
    n, vocab = dist.shape
    child_of = torch.full((n + 2, vocab), -1, dtype=torch.int32, device=dist.device)
    child_of[torch.where(parents >= 0, parents, n), tokens] = torch.arange(n, dtype=torch.int32, device=dist.device)  # siblings' tokens are distinct

    def level(node: Tensor, draws: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        choice = (dist[node] / draws[0] if draws else dist[node]).argmax(dim=-1)
        return choice, child_of[node, choice]

    return level


def _reject_levels(target_dist: Tensor, draft_probs: Tensor, node_tokens: Tensor, child_ids: Tensor) -> Level:
    """Recursive rejection (:func:`reject_forest`) with C uniforms and V Exp(1)
    variates per walker and level, used or not, so that a level draws as much whatever
    happens in it: the children in draft-rank order, a rejected one's draft mass taken
    from the residual; after the last, a draw from the residual (the argmax of residual /
    variate, as ``torch.multinomial``)."""
    tokens = torch.where(child_ids >= 0, node_tokens[child_ids.clamp(min=0)], -1)
    tiny = torch.finfo(torch.float64).tiny

    def level(node: Tensor, draws: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        uniforms, variates = draws
        residual, draft = target_dist[node].double(), draft_probs[node].double()  # node -1: rows never taken
        child, trying = torch.full_like(node, -1), node >= 0
        for column in range(child_ids.shape[1]):
            candidate, x = child_ids[node, column], tokens[node, column].clamp(min=0)[:, None]
            trying = trying & (candidate >= 0)
            take = trying & (uniforms[:, column] * draft.gather(1, x)[:, 0] <= residual.gather(1, x)[:, 0])
            child = torch.where(take, candidate, child)
            rejected = (trying & ~take)[:, None]
            left = (residual - draft).clamp(min=0)
            mass = left.sum(dim=1, keepdim=True)
            residual = torch.where(rejected & (mass > 0), left / mass.clamp(min=tiny), residual)
            draft = torch.where(rejected, draft.scatter(1, x, 0.0), draft)
            total = draft.sum(dim=1, keepdim=True)
            draft = torch.where(rejected & (total > 0), draft / total.clamp(min=tiny), draft)
            trying = trying & ~take & (total[:, 0] > 0)  # no draft mass left: no child can be drawn
        correction = (residual.float() / variates).argmax(dim=-1)
        return torch.where(child >= 0, node_tokens[child.clamp(min=0)], correction), child

    return level


def _threshold_levels(accept_prob: Tensor, residual: Tensor, tokens: Tensor, child_ids: Tensor) -> Level:
    """:func:`chain_acceptance` with one uniform and V Exp(1) variates per walker and
    level, used or not: the child is taken where the uniform falls below its node's
    probability, else the residual's draw (as ``torch.multinomial``) is emitted."""

    def level(node: Tensor, draws: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        uniforms, variates = draws
        child = torch.where(node >= 0, child_ids[node, 0], -1)
        take = (uniforms[:, 0] < accept_prob[node].double()) & (child >= 0)
        drawn = (residual[node].float() / variates).argmax(dim=-1)
        return torch.where(take, tokens[child.clamp(min=0)], drawn), torch.where(take, child, -1)

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
        draws = (("uniform_", 1, torch.float64), ("exponential_", residual.shape[-1], torch.float32))
        return _walk_on_device(chain, [0], [generator], _threshold_levels, (accept_prob, residual, chain.tokens, chain.child_ids), draws)[0]
    uniforms = torch.rand(accept_prob.shape, generator=generator, dtype=torch.float64, device=residual.device)
    accepted = (uniforms < accept_prob.double()).tolist()
    path, node, next_ids = [0], 0, chain.child_ids[:, 0].tolist()
    while next_ids[node] >= 0 and accepted[node]:
        node = next_ids[node]
        path.append(node)
    return Acceptance(path, int(torch.multinomial(residual[node].float(), 1, generator=generator)))


def reject_forest(
    forest: DraftTree, roots: Sequence[int], target_dist: Tensor, generators: Sequence[torch.Generator | None], compiled: bool = False
) -> list[Acceptance]:
    """SpecInfer / Sequoia multi-draft rejection, for trees whose children were drawn
    without replacement from the drafter's distribution at their parent, on every tree of
    a forest (its roots at ``roots``; or one tree, root 0), tree g drawing from
    ``generators[g]``.  Sibling x_j is accepted with min(1, r(x_j) / q_j(x_j)); on
    rejection the residual becomes r <- norm(max(r - q_j, 0)) and q drops x_j.  Exact for
    a fixed target p.

    On the host each tree draws only what it uses (:func:`_reject_on_host`).  Where a host
    read stalls, one device program for every tree (:func:`_reject_levels`): a level draws
    the same whatever happens in it, so its draws are not the host's, but its law is the
    same.  Paths and tokens come back per tree, in that tree's own node ids, with their
    device tensors (``walked``)."""
    if forest.draft_probs is None:
        raise ValueError("recursive rejection needs the draft distributions of a sampled tree")
    if stalls.host_reads_stall(target_dist.device) and None not in generators:
        draws = (("uniform_", forest.child_ids.shape[1], torch.float64), ("exponential_", target_dist.shape[-1], torch.float32))
        tensors = (target_dist, forest.draft_probs, forest.tokens, forest.child_ids)
        return _walk_on_device(forest, roots, generators, _reject_levels, tensors, draws, compiled)  # type: ignore[arg-type]
    trees, dists = ([forest], [target_dist]) if forest.images is None else (forest.trees(), target_dist.split(list(forest.sizes)))
    walks = [_reject_on_host(tree, dist, generator) for tree, dist, generator in zip(trees, dists, generators)]
    return _copied([path for path, _ in walks], [new for _, new in walks], forest.tokens.device)


def accept_forest(
    forest: DraftTree, roots: Sequence[int], dist: Tensor, target_dist: Tensor, sampling: Sampling, exact: bool,
    generators: Sequence[torch.Generator | None], compiled: bool = False,
) -> list[Acceptance]:
    """The core's rule on every tree of a forest (or one tree, root 0): recursive rejection
    against ``target_dist`` where it applies (a sampled tree, sampled tokens, an exact
    stack), else sample-and-match on ``dist`` (greedy at temperature 0), whose device walk
    measures the budget each path spent where ``dist`` is not ``target_dist``; the device
    walk compiled where ``compiled``."""
    if not sampling.greedy and exact and forest.sampled:
        return reject_forest(forest, roots, target_dist, generators, compiled)
    return walk_forest(forest, roots, dist, None if sampling.greedy else generators, compiled, target_dist)


def _reject_on_host(tree: DraftTree, target_dist: Tensor, generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """One tree's recursive rejection on the host, drawing only what it uses: a uniform per
    child it tries, and the residual's draw where it rejects them all.  Its path and new
    tokens (the path's after the root, then the next token)."""
    assert tree.draft_probs is not None
    tokens, children = tree.tokens.tolist(), tree.children
    path, node = [0], 0
    while True:
        residual, draft = target_dist[node].double(), tree.draft_probs[node].to(torch.float64, copy=True)  # a float64 row would be the tree's own
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
            return path, [tokens[node] for node in path[1:]] + [int(torch.multinomial(residual.float(), 1, generator=generator))]
        path.append(accepted)
        node = accepted
