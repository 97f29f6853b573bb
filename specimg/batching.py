"""The batched speculative step: a batch's images decoded together, ``batch_size`` at a time.

Each image drafts in its own lane (its own generator and planner) as it would alone; the
lanes' trees are grown together (or proposed side by side, :mod:`specimg.lockstep`),
verified in one forward of the target's, relaxed as one forest and accepted in one call
where the core's rule accepts, then committed together.  The functions take the
:class:`~specimg.engine.Engine` whose settings, relaxation and acceptance they run."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from torch import Tensor

from specimg import accept as acceptance
from specimg import stalls
from specimg.lane import Booking, Lane
from specimg.lockstep import BatchDrafting, LaneDrafter, Lockstep
from specimg.models.base import BatchTrees, Condition, TargetOutput, draft_features
from specimg.planner import TreePlanner
from specimg.sampling import cfg_active_at
from specimg.stats import ImageStats
from specimg.step import Acceptance, Scores, Walked
from specimg.tree import BatchSession, DraftTree, build_dynamic_batch, dynamic_shape, fixed_growth, grow_forest, stack_trees

if TYPE_CHECKING:
    from specimg.engine import Engine, OnImage
    from specimg.models.eagle import DraftBatch


class LaneStep(NamedTuple):
    """One image's step in a batch once accepted: its tree, its own scores, q_R, the
    acceptance and its walk (the path the target commits, on the device)."""

    tree: DraftTree
    scores: Scores
    dist: Tensor
    result: Acceptance
    walked: Walked


def decode(
    engine: Engine, conditions: Sequence[Condition], seeds: Sequence[int], progress: Callable[[int], None] | None,
    done: OnImage, planners: Callable[[], TreePlanner] | None = None,
) -> None:
    """Speculative decoding of the images ``batch_size`` at a time, each handed to
    ``done`` (index, tokens, statistics) when it finishes, in a lane of its own (its
    planner from ``planners``, by default the engine's); the lanes step together
    (:func:`step`).  When an image finishes, the next takes its place (``refill``), so
    the batch stays full until the images run out; a finished lane with none to follow
    rides along as a one-node tree that commits nothing, as does a lane its planner sent
    to AR.  When every unfinished image was sent to AR, they take AR steps together, one
    forward per token, until a place frees or to the end.  An image's wall time is its
    share of the batch's while it decoded."""
    target, sampling, device = engine.target, engine.sampling, engine.device
    assert isinstance(target, BatchTrees)
    size = min(engine.batch_size, len(conditions))
    lockstep = None if engine.drafter_free else Lockstep(engine.drafter.batch(size, sampling.cfg), engine._threads)  # type: ignore[union-attr]
    drafters = [None if lockstep is None else LaneDrafter(lockstep, place, engine.drafter) for place in range(size)]
    decoding = list(range(size))  # the image at each place of the batch
    waiting = collections.deque(range(size, len(conditions)))
    rules = engine._rules()

    def lane(place: int, out: TargetOutput) -> Lane:
        image = decoding[place]
        generator, first, tokens = engine._first_token(out, seeds[image], progress)
        planner = (planners or engine.planner)() if engine.auto_tree else None
        return Lane(rules, drafters[place], conditions[image], out, first, tokens, generator, ImageStats(target_forwards=1), planner, progress)

    with torch.inference_mode():
        prefill = target.prefill_batch(conditions[:size], sampling.cfg, tree_nodes=getattr(target, "max_tree_nodes", 128))
        lanes = [lane(place, TargetOutput(*(t if t is None else t[:, place : place + 1] for t in prefill))) for place in range(size)]
        live = set(range(size))  # places whose image is not handed over yet
        while live:
            running = []  # the places with an unfinished image
            for place in sorted(live):
                if not lanes[place].done:
                    running.append(place)
                    continue
                finished = lanes[place]
                finished.close(size)
                finished.stats.wall = (time.perf_counter() - finished.started) / size
                done(decoding[place], torch.tensor(finished.tokens), finished.stats)
                live.discard(place)
                if waiting:
                    decoding[place] = waiting.popleft()
                    lanes[place] = lane(place, target.refill(place, conditions[decoding[place]]))
                    live.add(place)
                    if not lanes[place].done:  # (an image of one token is done with its first)
                        running.append(place)
            if not running:
                continue
            riding = [place for place in running if lanes[place].goes_ar]  # sent to AR by their planners
            if len(riding) < len(running):
                step(engine, lanes, running, riding, lockstep)
                continue
            left = [target.num_tokens - len(lanes[place].tokens) for place in running]
            steps = min(left) if waiting else max(left)  # until a place frees, or to the end
            last = stalls.on_device([lane.tokens[-1] for lane in lanes], device)  # each image's root
            with Booking("verify", [lane for lane in lanes if not lane.done]):
                if len({len(lane.tokens) for lane in lanes}) == 1:  # then they also finish together: the batched AR step, no slots or mask
                    engine._ar(lanes, last, steps, len(lanes[0].tokens), lambda last, _: target.forward_batch(last), None, progress)
                    continue
                remaining = [target.num_tokens - len(lane.tokens) for lane in lanes]  # a finished image rides along and commits nothing
                depths, mask = torch.zeros(size, 1, dtype=torch.long, device=device), torch.ones(size, 1, 1, dtype=torch.bool, device=device)
                root, nothing = torch.zeros(1, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.long, device=device)
                engine._ar(lanes, last, steps, stalls.on_device([len(lane.tokens) for lane in lanes], device),  # the token each draws first
                           lambda last, _: target.forward_trees(last[:, None], depths, mask).logits[:, :, 0],
                           lambda at: target.commit_trees([root if left > at else nothing for left in remaining]), progress)


def step(engine: Engine, lanes: Sequence[Lane], running: Sequence[int], riding: Sequence[int], lockstep: Lockstep | None) -> None:
    """One step of every unfinished image (the places ``running``): draft every tree
    (grown together where the core grows EAGLE-2 trees, else side by side with the
    drafter calls batched), verify them all in one forward, relax their forest at once (a
    member that takes no batch, tree by tree), accept each, commit them all.  The places
    ``riding`` (sent to AR by their planners) verify a one-node tree each."""
    target, device = cast(BatchTrees, engine.target), engine.device  # checked once, when the batch began
    drafting = {i: lanes[i] for i in running if i not in riding}
    together = _draft_together(engine, drafting, lockstep.batch) if lockstep else None
    if together is None:  # side by side
        proposing = {i: lane.propose for i, lane in drafting.items()}
        together = lockstep.run(proposing) if lockstep else {i: propose() for i, propose in proposing.items()}, None
    proposed, forest = together
    drafted = list(proposed.values())
    if drafted and forest is None:
        forest = DraftTree.forest(drafted)
    stepping = [lanes[i] for i in running]
    with Booking("verify", stepping):
        if forest is not None and len(proposed) == len(lanes):
            stacked = forest.stacked()
        else:  # a finished or riding image's place verifies its root
            stacked = stack_trees([proposed[i] if i in proposed else lane.root_tree() for i, lane in enumerate(lanes)])
        scores, root_probs = _verify(engine, stacked, forest.sizes if forest is not None else (), lanes, list(proposed), riding)
    paths = [torch.zeros(0, dtype=torch.long, device=device)] * len(lanes)  # a finished image commits nothing
    with Booking("verify", [lanes[i] for i in riding]):  # every riding image's token drawn from its own generator, read once
        root_tokens = engine._sample_rows(root_probs, [lanes[i].generator for i in riding]).tolist() if riding else []
    for i, token in zip(riding, root_tokens):
        lane = lanes[i]
        lane.tokens.append(token)
        lane.stats.target_forwards += 1
        paths[i] = torch.zeros(1, dtype=torch.long, device=device)  # the root alone
        if lane.progress:
            lane.progress(1)
    steps = {} if forest is None else _relax_and_accept(engine, scores, list(proposed), [lanes[i] for i in proposed], forest, drafted)
    for i, done in steps.items():
        paths[i] = done.walked.path
    with Booking("commit", stepping):
        target.commit_trees(paths)
        features: list[Tensor | None] = [None] * len(steps)  # the drafter's features at each accepted path, picked in one gather
        if steps and engine.drafter is not None:
            assert forest is not None
            nodes = stalls.on_device([start + node for (start, _), done in zip(forest.spans, steps.values()) for node in done.result.path], device)
            features = list(draft_features(engine.drafter, scores)[:, nodes].split_with_sizes([len(done.result.path) for done in steps.values()], 1))
        for (i, done), hidden in zip(steps.items(), features):
            lanes[i].advance(done.tree, done.scores, done.result, done.walked, hidden)
    for i, done in steps.items():
        lanes[i].learn(done.tree, done.dist, done.result, done.walked)


def _draft_together(engine: Engine, lanes: Mapping[int, Lane], batch: BatchDrafting) -> tuple[dict[int, DraftTree], DraftTree | None] | None:
    """Every drafting lane's tree, grown together where the core grows EAGLE-2 trees
    (no method brings its own, no static tree): one drafter call and one top-k per level
    for all the lanes that draft one shape (:func:`specimg.tree.build_dynamic_batch`;
    at fixed shapes one program for every place, :func:`specimg.tree.grow_forest`), each tree
    the one its lane grows alone; and where every lane drafted one shape, their forest.
    None otherwise: the lanes then propose side by side (:mod:`specimg.lockstep`)."""
    assert engine.hooks is not None
    sampling, device = engine.sampling, engine.device
    shapes = {i: dynamic_shape(lane.tree_config, lane.max_depth) for i, lane in lanes.items()}
    if not lanes or engine.hooks.propose.owner is not None or None in shapes.values():
        return None
    with Booking("draft", list(lanes.values())):
        roots = batch.start({i: (lane.hidden, lane.new_ids) for i, lane in lanes.items()})
        trees: dict[int, DraftTree] = {}
        forest = None
        for shape in dict.fromkeys(shapes.values()):
            assert shape is not None
            depth, topk, nodes, sample = shape
            images = [i for i in lanes if shapes[i] == shape]
            if depth == 0:  # the image's last token: the root alone
                trees.update((i, lanes[i].root_tree()) for i in images)
                continue

            if getattr(batch, "step_mode", "eager") != "eager" and fixed_growth(shape, sampling):  # a DraftBatch at fixed shapes
                grown = grow_forest(cast("DraftBatch", batch), sampling, {i: (roots[i], lanes[i].tokens[-1]) for i in images}, shape)
                every_place = grown.trees()
                trees.update((i, every_place[i]) for i in images)
                forest = grown if len(images) == len(every_place) else None  # a forest of these images' trees alone
                continue

            root_logits = torch.stack([roots[i] for i in images], dim=1)
            root_tokens = stalls.on_device([lanes[i].tokens[-1] for i in images], device)

            def expand(parents: Tensor, tokens: Tensor, images: list[int] = images) -> Tensor:
                fed = batch.expand(dict(zip(images, zip(parents.unbind(), tokens.unbind()))))
                return torch.stack([fed[i] for i in images], dim=1)

            root_index = stalls.on_device([len(lanes[i].tokens) - 1 for i in images], device)
            session = BatchSession(expand, sampling, root_logits, root_index, filtered=sample)
            generators = [lanes[i].generator for i in images] if sample else None
            forest = build_dynamic_batch(session, root_tokens, depth, topk, nodes, sample, generators)
            trees.update(zip(images, forest.trees()))
    return {i: trees[i] for i in lanes}, forest if forest is not None and len(forest.sizes) == len(lanes) else None


def _verify(
    engine: Engine, stacked: tuple[Tensor, Tensor, Tensor], sizes: Sequence[int], lanes: Sequence[Lane], places: Sequence[int], riding: Sequence[int]
) -> tuple[Scores, Tensor]:
    """Every place's tree (``stacked``: tokens, depths [B, n], masks [B, n, n]) verified
    in one forward: the scores of the trees drafted at ``places`` (``sizes`` nodes each:
    their forest's nodes, tree after tree), and the distributions at the roots of the
    places ``riding``."""
    target, sampling, device, width = cast(BatchTrees, engine.target), engine.sampling, engine.device, stacked[0].shape[1]
    verified, counts = [*places, *riding], [*sizes, *[1] * len(riding)]  # the drafted trees, then the riding roots
    nodes = stalls.on_device([place * width + k for place, count in zip(verified, counts) for k in range(count)], device)  # each tree's first count places
    picked = TargetOutput(*[t if t is None else t.flatten(1, 2)[:, nodes] for t in target.forward_trees(*stacked)])
    active: bool | Tensor = True  # guidance throughout: no token index needed
    if sampling.cfg_interval >= 0:
        predicted = stalls.on_device([len(lanes[place].tokens) for place in verified], device)  # the image token each tree's root predicts
        per_node = predicted.repeat_interleave(stalls.on_device(counts, device), output_size=sum(counts))
        active = cfg_active_at(stacked[1].flatten()[nodes], sampling, per_node)
    scores = Scores(engine._probabilities(picked.logits, active), picked.hidden, picked.logits, picked.layers)
    if not riding:
        return scores, scores.probs[:0]
    drafted, roots = scores.split([sum(sizes), len(riding)])
    return drafted, roots.probs


def _relax_and_accept(
    engine: Engine, scores: Scores, places: Sequence[int], lanes: Sequence[Lane], forest: DraftTree, trees: Sequence[DraftTree]
) -> dict[int, LaneStep]:
    """The batch's drafted ``trees`` (of ``lanes`` at ``places``) as their ``forest``,
    its ``scores`` from the verify: its q_R in one pass, then every lane's acceptance
    of its own rows, all in one call under the core's own rule
    (:func:`specimg.accept.accept_forest`: one device program on a device) where the
    stack's ``accept`` passes on every tree, else lane by lane.  Per place, its step."""
    sizes, starts = forest.sizes, [a for a, _ in forest.spans]
    with Booking("relax", lanes):
        dist = engine.relax(forest, scores)
    own = scores.split(sizes)  # each image's scores, and its q_R (p itself where nothing relaxed)
    dists = [mine.probs for mine in own] if dist is scores.probs else list(dist.split_with_sizes(sizes))
    assert engine.hooks is not None
    with Booking("accept", lanes):
        methods = [] if engine.hooks.accept.owner is None else [engine._method_accept(*step, lane.generator) for lane, step in zip(lanes, zip(trees, dists, own))]
        if all(result is None for result in methods):  # the core's own rule (no member's, or it passed on every tree): every lane at once
            results = acceptance.accept_forest(forest, starts, dist, scores.probs, engine.sampling, engine.exact, [lane.generator for lane in lanes],
                                               engine.compiled)
        else:
            results = [acceptance.accept_forest(tree, [0], q, mine.probs, engine.sampling, engine.exact, [lane.generator], engine.compiled)[0]
                       if result is None else result for lane, tree, q, mine, result in zip(lanes, trees, dists, own, methods)]
        walks = [lane.walked(*step) for lane, step in zip(lanes, zip(trees, own, dists, results))]
    return {place: LaneStep(tree=tree, scores=mine, dist=q, result=result, walked=walk)
            for place, tree, mine, q, result, walk in zip(places, trees, own, dists, results, walks)}
