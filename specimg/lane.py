"""One image under speculative decoding: what its steps carry from one to the next.

A step is draft -> verify -> relax -> accept -> commit.  The engine verifies (one
image alone, or every image of a batch in one forward), relaxes, accepts and commits,
and grows a batch's trees together; the image's lane drafts its tree and keeps the
rest: its tokens, generator, statistics, planner and drafter.  A lane never calls back
into the engine: what it needs of it comes as :class:`Rules`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch
from torch import Tensor

from specimg import relax, stalls
from specimg.config import Sampling, TreeConfig
from specimg.models.base import Condition, Drafter, Target, TargetOutput, draft_features
from specimg.planner import TreePlanner
from specimg.stats import ImageStats
from specimg.step import Acceptance, Scores, Step, Walked
from specimg.tree import DraftSession, DraftTree


@attrs.frozen
class Rules:
    """What every lane of a decode shares, handed over by the engine that drives them: the
    target, the sampling, the tree where no planner shapes it, the stack's propose_tree and
    the observer of each step (:attr:`specimg.engine.Engine.on_step`)."""

    target: Target
    sampling: Sampling
    tree_config: TreeConfig
    propose: Callable[..., DraftTree]
    on_step: Callable[[DraftTree, Tensor, list[int]], None] | None


class Lane:
    """One image's speculative decoding after its prefill and first token (``tokens``)."""

    def __init__(
        self,
        rules: Rules,
        drafter: Drafter | None,
        condition: Condition,
        prefill: TargetOutput,
        first: Tensor,
        tokens: list[int],
        generator: torch.Generator,
        stats: ImageStats,
        planner: TreePlanner | None,
        progress: Callable[[int], None] | None,
    ):
        self.rules, self.drafter, self.tokens, self.generator = rules, drafter, tokens, generator
        self.stats, self.planner, self.progress = stats, planner, progress
        self.device = device = first.device
        if drafter is not None:
            drafter.prefill(condition, rules.sampling.cfg)
            self.hidden = draft_features(drafter, prefill)
        self._one_node = DraftTree.from_tensors(torch.tensor(tokens[-1:], device=device), torch.tensor([-1], device=device),
                                                torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, device=device), width=0, height=0)
        self.previous = Step(self._one_node, Scores(first, prefill.hidden, prefill.logits, prefill.layers), Acceptance([0], tokens[-1]))  # the prefill as a step
        self.new_ids = torch.tensor(tokens[-1:], device=device)
        self.spent: list[Tensor] = []  # per step, TVD(q_R, p) over the walked path's nodes (summed when the image closes)
        self.started = time.perf_counter()
        self.ar_since: float | None = None  # when the planner sent the image to AR
        # Whether the planner found no tree that pays: the rest of the image is AR (the planner
        # learns nothing more, so this holds to the end).  Set again by each lesson.
        self.goes_ar = planner is not None and planner.plan.is_ar
        if self.goes_ar:  # the measured acceptance says no tree pays: AR from the first step
            self._book_ar_rest()

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.rules.target.num_tokens

    def root_tree(self) -> DraftTree:
        """The one-node tree of the last token: an AR step (the first one's columns, the token
        copied in)."""
        return attrs.evolve(self._one_node, tokens=stalls.on_device(self.tokens[-1:], self.device))

    @property
    def tree_config(self) -> TreeConfig:
        """This step's tree: the planner's, else the engine's."""
        return self.planner.tree if self.planner else self.rules.tree_config

    @property
    def max_depth(self) -> int:
        """The deepest tree this step may draft: the tokens still missing after the next."""
        return self.rules.target.num_tokens - len(self.tokens) - 1

    def propose(self) -> DraftTree:
        """This step's draft tree, by the stack's propose_tree."""
        rules, sampling, tokens = self.rules, self.rules.sampling, self.tokens
        tree_config = self.tree_config
        with Booking("draft", [self]):
            session = None
            if self.drafter is not None:
                root_logits = self.drafter.start(self.hidden, self.new_ids)
                session = DraftSession(self.drafter, sampling, root_logits, len(tokens) - 1, filtered=tree_config.sample)
            return rules.propose(
                session=session, root_token=tokens[-1], tree_config=tree_config,
                max_depth=self.max_depth, previous=self.previous, image_tokens=tokens, target=rules.target,
                sampling=sampling, generator=self.generator,
            )

    def walked(self, tree: DraftTree, scores: Scores, dist: Tensor, result: Acceptance) -> Walked:
        """The accepted path on the device (one copy where the rule handed none over);
        the budget its nodes spent (q_R against p, where q_R is not p itself; measured by
        the walk where it did) is booked."""
        walked = result.walked
        if walked is None:  # a method's own accept returned the path alone: one copy to the device, one read back
            path = torch.tensor(result.path, dtype=torch.long, device=tree.tokens.device)
            new_tokens = tree.tokens[path[1:]].tolist() + [result.next_token]
            walked = Walked(path, torch.tensor(new_tokens, device=path.device), new_tokens)
        if dist is not scores.probs:
            spent = walked.spent if walked.spent is not None else relax.tvd(dist[walked.path], scores.probs[walked.path]).sum()
            self.spent.append(spent)
        return walked

    def advance(self, tree: DraftTree, scores: Scores, result: Acceptance, walked: Walked, hidden: Tensor | None = None) -> None:
        """After the target committed the walked path: the drafter's next features (picked
        here, unless a batch picked every lane's at once: ``hidden``), the new tokens and
        the step the next proposal sees.  Untimed: the caller books it with its commit."""
        self.new_ids, new_tokens = walked.new_tokens, walked.token_list
        if self.drafter is not None:
            self.hidden = hidden if hidden is not None else draft_features(self.drafter, scores)[:, walked.path]
        self.tokens.extend(new_tokens)
        self.previous = Step(tree, scores, result)

    def learn(self, tree: DraftTree, dist: Tensor, result: Acceptance, walked: Walked) -> None:
        """After :meth:`advance`: the planner's lesson from the step, and its statistics."""
        stats, planner = self.stats, self.planner
        if planner:  # the step booked against its plan's prediction, then the planner's lesson
            self._book(planner, 1)
            planner.observe(tree, dist, walked.path, self.rules.sampling.greedy)
            self.goes_ar = planner.plan.is_ar
        if self.rules.on_step:
            self.rules.on_step(tree, dist, result.path)
        stats.target_forwards += 1
        stats.tree_sizes.append(tree.size)
        stats.accepted.append(len(result.path) - 1)
        if self.progress:
            self.progress(len(walked.token_list))
        if self.goes_ar and not self.done:
            self._book_ar_rest()

    def _book(self, planner: TreePlanner, steps: int) -> None:
        """Book ``steps`` steps of the planner's plan (a tree it switched to from the step
        on) and the cost model's prediction for them."""
        plan, stats = planner.plan, self.stats
        if not stats.trees or stats.trees[-1][1:] != [plan.depth, plan.topk, plan.nodes]:
            stats.trees.append([len(stats.accepted), plan.depth, plan.topk, plan.nodes])
        stats.predicted_ms += steps * plan.step_ms
        stats.predicted_ar_ms += steps * plan.tokens_per_step * planner.cost.ar_ms

    def _book_ar_rest(self) -> None:
        """The planner sent the image to AR: book the rest of it as one-node steps that
        accept nothing, with the AR plan's prediction (the engine decodes them)."""
        assert self.planner is not None
        steps = self.rules.target.num_tokens - len(self.tokens)
        self.ar_since = time.perf_counter()
        self._book(self.planner, steps)
        self.stats.tree_sizes.extend([1] * steps)
        self.stats.accepted.extend([0] * steps)

    def close(self, images: int = 1) -> None:
        """The budget spent per emitted draw, and with auto trees the time its drafted and
        its AR steps took (the share of one of ``images`` decoded together), into the
        statistics."""
        stats = self.stats
        if self.planner is not None:
            now = time.perf_counter()
            switched = now if self.ar_since is None else self.ar_since
            stats.drafted_seconds, stats.ar_seconds = (switched - self.started) / images, (now - switched) / images
        stats.tokens = len(self.tokens)
        spent = float(torch.stack(self.spent).sum()) if self.spent else 0.0
        stats.tvd = spent / max(1, sum(stats.accepted) + len(stats.accepted))


class Booking:
    """A ``with`` block whose time is booked to ``phase``, each of ``lanes`` (a batch's
    images stepping together) its equal share.  A class, not a generator context manager:
    a step enters several, and this one makes three Python calls instead of seven."""

    __slots__ = ("phase", "lanes", "start")

    def __init__(self, phase: str, lanes: Sequence[Lane]):
        self.phase, self.lanes = phase, lanes

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        share = (time.perf_counter() - self.start) / max(1, len(self.lanes))
        for lane in self.lanes:
            lane.stats.seconds[self.phase] += share
