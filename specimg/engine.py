"""The decode loop: prefill, then draft -> score -> relax -> accept -> commit per step."""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, cast

import attrs
import torch
from torch import Tensor

from specimg import accept as acceptance
from specimg import batching, costs, relax, stalls
from specimg.config import Sampling, TreeConfig
from specimg.costmodel import CostModel
from specimg.errors import SpecimgError
from specimg.compiled import Compile, CompileClock, Refused, compiles, run, step_mode
from specimg.lane import Booking, Lane, Rules
from specimg.methods import AR, Stack
from specimg.models.base import BatchSteps, BatchTrees, Condition, Drafter, Target, TargetOutput, placed
from specimg.planner import TreePlanner
from specimg.profile import AcceptanceProfile
from specimg.progress import progress_bar
from specimg.plugins import PluginManager, get_plugin_manager
from specimg.sampling import cfg_active_at, draw_rows, probabilities
from specimg.stackhooks import MemberHook, StackHooks
from specimg.stats import ImageStats, RunStats
from specimg.step import Acceptance, Scores
from specimg.tree import DraftTree

OnImage = Callable[[int, Tensor, ImageStats], None]
"""Called with an image's index among the conditions, its tokens and statistics when it is done."""

MEASURING = "measuring this machine's step costs for auto trees (once, then cached)"
"""The bar on stderr while an engine's first use measures (see :meth:`Engine.prepare`)."""


class ARImage(NamedTuple):
    """What the AR loop keeps of an image (a lane keeps it too): its generator, tokens and statistics."""

    generator: torch.Generator
    tokens: list[int]
    stats: ImageStats


class Generation(NamedTuple):
    """Image tokens [images, tokens_per_image] and the statistics of the run."""

    tokens: Tensor
    stats: RunStats


def ar_tokens(target: Target, conditions: Sequence[Condition], seeds: Sequence[int], sampling: Sampling) -> Tensor:
    """AR images, one per condition, image i drawn with seed ``seeds[i]``: tokens [B,
    num_tokens], in one batch where the target has batched steps, else one at a time."""
    batch = len(conditions) if isinstance(target, BatchSteps) else 1
    return Engine(target, method=AR, sampling=sampling, batch_size=max(1, batch)).generate(conditions, seeds=seeds).tokens


class Engine:
    """Generates image tokens with a target, a drafter and a method stack.

    ``method`` is ``"ar"`` (plain autoregressive decoding) or a stack such as
    ``"cascade+lantern"``; ``options`` maps method names to option values; ``delta`` sets
    the stack's total-variation budget (default: the largest member delta).

    Everything runs on the target's device: ``device`` and ``dtype``, when given, move the
    models there first.  ``compile``: "auto" runs the target's step forwards (and an EAGLE
    drafter's), the sampling's distributions and the stack's relaxation as programs
    compiled by ``torch.compile`` (captured as CUDA graphs) when the target is on a GPU and
    has fixed-shape steps (LlamaGen), and eagerly elsewhere; "on" compiles on any device
    (inductor's C++ on a CPU), "off" never (:mod:`specimg.compiled`).  An auto tree (the
    default) is chosen per step from ``cost_model``, measured on first use when not given
    (see :mod:`specimg.costs`).
    ``batch_size``: how many images decode together, one forward per token for all of
    them (method "ar" on a target with batched steps, :class:`~specimg.models.base.BatchSteps`).
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        method: str = "naive",
        options: Mapping[str, Mapping[str, Any]] | None = None,
        sampling: Sampling = Sampling(),
        tree: TreeConfig = TreeConfig(),
        delta: float | None = None,
        tokenizer: Any = None,
        plugins: PluginManager | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        cost_model: CostModel | None = None,
        compile: Compile = "auto",
        batch_size: int = 1,
    ):
        if device is not None or dtype is not None:
            target, drafter, tokenizer = (placed(m, device, dtype) for m in (target, drafter, tokenizer))
        self.target, self.drafter, self.sampling, self.tree_config = target, drafter, sampling, tree
        self.tokenizer, self.cost_model = tokenizer, cost_model
        self.device = costs.device_of(target)
        mode = step_mode(compile, self.device, supported=hasattr(target, "set_step_mode"))
        if mode == "compiled" or compile == "off":  # "auto" off a GPU leaves the models' step modes as they are
            for model in (target, drafter):
                if hasattr(model, "set_step_mode"):
                    model.set_step_mode(mode)
        self._fold_compiles = True  # until the compiler refuses the stack's relaxation (it reads the host): then it folds eagerly
        self.check_relax = relax.checks_enabled()
        self.calibration_seconds = 0.0
        """What :meth:`prepare` spent measuring this machine's costs and calibrating the stack (0 when the cache had them)."""
        self.on_step: Callable[[DraftTree, Tensor, list[int]], None] | None = None
        """Called after each speculative step with its tree, q_R and accepted path (tools that learn from a run)."""
        self.plugins = plugins or get_plugin_manager()
        for role, model in (("drafter", drafter), ("tokenizer", tokenizer)):
            size = getattr(model, "vocab_size", None)
            if size is not None and size != target.vocab_size:
                raise SpecimgError(f"the {role} has a vocabulary of {size} tokens, the target {target.vocab_size}")
        self.stack: Stack | None = None
        self.hooks: StackHooks | None = None
        self.batch_size = batch_size
        if batch_size < 1:
            raise SpecimgError(f"batch size {batch_size}: give 1 or more")
        if batch_size > 1 and not isinstance(target, BatchSteps):
            raise SpecimgError(f"batch size {batch_size} needs a target with batched steps (LlamaGen's); a {type(target).__name__} decodes one image at a time")
        if method.strip() == AR:
            if options:
                raise SpecimgError("method 'ar' takes no options")
            if delta is not None:
                raise SpecimgError("method 'ar' has no total-variation budget to set (delta)")
            return
        self.stack = self.plugins.stack(method, options, delta)
        self.tree_config = self.stack.released_tree(tree)  # a paper mode's released tree, where it has one
        if drafter is None and not self.drafter_free:
            raise SpecimgError(f"method {self.stack.name!r} drafts tokens and needs a drafter")
        self.hooks = StackHooks.bind(self.plugins, self.stack)
        if self.drafter_free and self.hooks.propose.owner != self.stack.drafter_free:
            raise SpecimgError(f"method {self.stack.drafter_free!r} drafts without a drafter but does not implement propose_tree")
        if batch_size > 1:
            self._check_batch_trees()

    def _check_batch_trees(self) -> None:
        """Speculative decoding at a batch size above 1 verifies every image's tree in one
        forward of the target's and drafts them together, so it needs the core's scoring
        and a drafter that drafts for a batch (its images propose in threads of their own)."""
        assert self.hooks is not None and self.stack is not None
        size = self.batch_size
        if not isinstance(self.target, BatchTrees):
            raise SpecimgError(f"batch size {size} with method {self.stack.name!r} needs a target that verifies a batch of trees (LlamaGen's)")
        if self.hooks.score.owner is not None:
            raise SpecimgError(f"method {self.hooks.score.owner!r} scores trees itself, one image at a time: run it at batch size 1")
        if self.drafter_free:
            return
        if not hasattr(self.drafter, "batch"):
            raise SpecimgError(f"batch size {size} needs a drafter that drafts for a batch (batch()); a {type(self.drafter).__name__} drafts for one image at a time")
        if getattr(self.drafter, "context", 0):
            raise SpecimgError(f"batch size {size}: this drafter reads the whole condition (LANTERN's released drafters), which batched decoding does not give it yet; run at batch size 1")
        self._threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix="specimg-lane")

    @property
    def compiled(self) -> bool:
        """Whether the step's programs are compiled (the target's step mode is)."""
        return compiles(self.target)

    def _probabilities(self, logits: Tensor, cfg_active: bool | Tensor = True) -> Tensor:
        """The sampling's distributions of ``logits`` (guidance, filters, softmax), a
        compiled program where the step's are: its guards hold this engine's sampling."""
        return run(probabilities, logits, self.sampling, cfg_active, compiled=self.compiled)

    @property
    def method(self) -> str:
        return self.stack.name if self.stack else AR

    def generate(
        self, conditions: Sequence[Condition], seed: int = 0, progress: Callable[[int], None] | None = None,
        seeds: Sequence[int] | None = None, on_image: OnImage | None = None,
    ) -> Generation:
        """Generate one image per condition; image i uses seed ``seed + i`` (or ``seeds[i]``),
        so results do not depend on how the conditions are batched.  ``progress`` is called
        with each step's token count; ``on_image`` with each image's index in
        ``conditions``, its tokens [num_tokens] (on the CPU) and statistics as soon as it
        is done (in a speculative batch, images finish out of order)."""
        seeds = [seed + i for i in range(len(conditions))] if seeds is None else [int(s) for s in seeds]
        if len(seeds) != len(conditions):
            raise SpecimgError(f"{len(seeds)} seeds for {len(conditions)} conditions: give one per condition")
        rows: list[Tensor] = [torch.empty(0)] * len(conditions)  # each replaced when its image is done
        stats: list[ImageStats] = [ImageStats() for _ in conditions]

        def done(index: int, tokens: Tensor, image: ImageStats) -> None:
            rows[index], stats[index] = tokens, image
            if on_image:
                on_image(index, tokens, image)

        if self.cost_model is None and conditions:
            self.prepare(conditions[0])
        self._decode(conditions, seeds, progress, done)
        return Generation(torch.stack(rows) if rows else torch.empty(0, self.target.num_tokens, dtype=torch.long), RunStats(tuple(stats)))

    def prepare(self, condition: Condition, state: Any = None) -> CostModel | None:
        """Attach the cost model that auto trees plan with (nothing to do for other trees):
        this machine's, read or measured (:mod:`specimg.costs`), with this stack's step
        scale.  Under accelerate (``state``) the main process prepares it and the others
        receive it, so that all of them plan alike.  ``generate`` calls it when needed."""
        if not self.auto_tree:
            return self.cost_model
        model = self._calibrated(condition) if state is None or state.is_main_process else None
        if state is not None and state.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            model = broadcast_object_list([model])[0]
        self.cost_model = model
        return model

    def _calibrated(self, condition: Condition) -> CostModel:
        """The cost model with this stack's step scale and acceptance.  The parts are timed
        in a tight loop, which misses what a real step adds (the method's relaxation, the
        loop's own Python).  So the first engine of a stack decodes ``batch_size`` images on
        auto trees (drafting to the end: no AR fallback), then AR images of the same
        condition, and scales the parts by how much longer each decode took than they
        predict, relative to AR's (:func:`specimg.costs.step_scale`): real steps against real
        AR steps, timed in the same minute.  The same decode measures how often the stack's
        drafts are accepted: every later planner's prior (where no tree is predicted to pay,
        an image runs AR from its first step).  Both are cached with the model, measured at
        this batch size (:func:`specimg.costs.measure`), so runs stay reproducible."""
        size, start = self.batch_size, time.perf_counter()
        name = costs.scale_key(self.stack)
        with contextlib.ExitStack() as bars:
            bar: list[Any] = []  # the bar that says what is measured, opened when measuring starts

            def measuring(_: str = "") -> Callable[[int], Any]:
                if not bar:
                    bar.append(bars.enter_context(progress_bar(total=2 * size * self.target.num_tokens, unit="tok", desc=MEASURING)))
                return bar[0].update

            model = costs.load_or_measure(self.target, self.drafter, self.sampling, condition, log=measuring, batch=size)
            if model.calibrated(name):
                return model
            parts = attrs.evolve(model, step_scales={**model.step_scales, name: 1.0}, acceptance={k: v for k, v in model.acceptance.items() if k != name})
            planners: list[TreePlanner] = []

            def planner() -> TreePlanner:
                planners.append(self.planner(parts, ar_fallback=False))
                return planners[-1]

            def wall(images: list[ImageStats], *how: Any) -> float:  # ``batch_size`` images of the condition, as generate decodes them
                self._decode([condition] * size, range(size), measuring(), lambda _, __, image: images.append(image), *how)
                return sum(image.wall for image in images)

            drafted: list[ImageStats] = []
            drafted_wall, ar_wall = self._steady(wall, drafted, planner), self._steady(wall, [], None, True)
            scale = costs.step_scale(drafted_wall, sum(image.predicted_ms for image in drafted), ar_wall, size * self.target.num_tokens * model.ar_ms)
            self.calibration_seconds = time.perf_counter() - start
            return costs.with_calibration(model, name, scale, AcceptanceProfile.pooled([p.profile for p in planners]).rates())

    def _steady(self, decode: Callable[..., float], *args: Any) -> float:
        """The wall seconds ``decode`` returns, less what it spent compiling: one-off work
        that no later step pays."""
        compiled = CompileClock.seconds
        return decode(*args) - (CompileClock.seconds - compiled)

    def _decode(
        self, conditions: Sequence[Condition], seeds: Sequence[int], progress: Callable[[int], None] | None, done: OnImage,
        planners: Callable[[], TreePlanner] | None = None, ar: bool = False,
    ) -> None:
        """One image per condition, each handed to ``done`` (index, tokens, statistics) when it
        finishes: one at a time, or ``batch_size`` at a time (:func:`specimg.batching.decode`,
        or AR images in one forward per token, each drawn as it would be alone, its wall
        time its share of the batch's); with AR steps whatever the method, with ``ar``.
        Auto trees plan with ``planners``' planners, by default :meth:`planner`'s."""
        if self.batch_size == 1:
            for index, (condition, seed) in enumerate(zip(conditions, seeds)):
                planner = (planners or self.planner)() if self.auto_tree and not ar else None
                stats, start = ImageStats(target_forwards=1), time.perf_counter()
                with torch.inference_mode():
                    prefill = self.target.prefill(condition, self.sampling.cfg)
                    generator, first, tokens = self._first_token(prefill, seed, progress)
                    if ar or self.stack is None:
                        self._ar_alone(ARImage(generator, tokens, stats), progress)
                    else:
                        drafter = None if self.drafter_free else self.drafter
                        self._decode_speculative(Lane(self._rules(), drafter, condition, prefill, first, tokens, generator, stats, planner, progress))
                stats.tokens, stats.wall = len(tokens), time.perf_counter() - start
                done(index, torch.tensor(tokens, dtype=torch.long), stats)
        elif self.stack is not None and not ar:
            batching.decode(self, conditions, seeds, progress, done, planners)
        else:
            target = cast(BatchSteps, self.target)
            for at in range(0, len(conditions), self.batch_size):
                batch = conditions[at : at + self.batch_size]
                images = [ARImage(torch.Generator(self.device).manual_seed(s), [], ImageStats()) for s in seeds[at : at + self.batch_size]]
                start = time.perf_counter()
                with torch.inference_mode():  # the prefill is the first step
                    self._ar(images, None, target.num_tokens, 0,
                             lambda last, step: target.forward_batch(last) if step else target.prefill_batch(batch, self.sampling.cfg).logits, None, progress)
                wall = (time.perf_counter() - start) / len(images)
                for row, image in enumerate(images):
                    image.stats.tokens, image.stats.wall = len(image.tokens), wall
                    done(at + row, torch.tensor(image.tokens), image.stats)

    def _rules(self) -> Rules:
        """What the lanes of a decode need of this engine (its ``on_step`` as set now)."""
        assert self.hooks is not None
        return Rules(self.target, self.sampling, self.tree_config, self.hooks.propose, self.on_step)

    def _first_token(self, prefill: TargetOutput, seed: int, progress: Callable[[int], None] | None) -> tuple[torch.Generator, Tensor, list[int]]:
        """An image's generator seeded ``seed``, its prefill's distribution and image token 0 drawn from it."""
        generator = torch.Generator(self.device).manual_seed(seed)
        first = self._probabilities(prefill.logits)
        tokens = self._sample_rows(first, [generator]).tolist()
        if progress:
            progress(1)
        return generator, first, tokens

    def _ar(
        self, images: Sequence[ARImage | Lane], last: Tensor | None, steps: int, first: int | Tensor, forward: Callable[[Tensor, int], Tensor],
        commit: Callable[[int], None] | None, progress: Callable[[int], None] | None,
    ) -> None:
        """The AR loop, for one image or a batch: ``steps`` steps of ``images`` from their last
        tokens ``last`` [B], the first drawing image token ``first`` (one index, or each
        image's).  ``forward(last, step)`` gives every image's next-token logits, then
        ``commit(step)`` commits the step where the forward does not.  Each image draws with
        its own generator as it would alone, and an image with no tokens left rides along,
        its draws dropped.  Each token stays on the device and feeds the next step; the host
        reads them all at the end, so no step waits for the device (on a GPU the host runs
        ahead and the launches overlap the work)."""
        remaining = [self.target.num_tokens - len(image.tokens) for image in images]
        drawn: list[Tensor] = []  # per step, every image's last token (a finished image's stays as it was)
        for step in range(steps):
            running = [i for i, left in enumerate(remaining) if left > step]
            probs = self._probabilities(forward(cast(Tensor, last), step), cfg_active_at(first + step, self.sampling))  # the finished images' go unused
            if len(running) == len(images):
                last = self._sample_rows(probs, [image.generator for image in images])
            else:
                at = stalls.on_device(running, self.device)
                last = cast(Tensor, last).index_copy(0, at, self._sample_rows(probs[at], [images[i].generator for i in running]))
            if commit:
                commit(step)
            drawn.append(last)
            if progress:
                progress(len(running))
        tokens = torch.stack(drawn, dim=1).tolist() if drawn else []  # the one read: [images, steps]
        for image, left, mine in zip(images, remaining, tokens):
            count = min(steps, left)  # an image draws at the steps before its own end
            if count > 0:
                image.tokens.extend(mine[:count])
                image.stats.target_forwards += count

    def _ar_alone(self, image: ARImage | Lane, progress: Callable[[int], None] | None) -> None:
        """The rest of one image, one token per forward (:meth:`_ar`)."""
        target, device = self.target, self.device
        root, mask = torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, 1, dtype=torch.bool, device=device)
        self._ar([image], torch.tensor(image.tokens[-1:], device=device), target.num_tokens - len(image.tokens), len(image.tokens),
                 lambda last, _: target.forward_tree(last, root, mask).logits, lambda _: target.commit(root), progress)

    def _sample_rows(self, probs: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
        """One token per row of ``probs`` [B, V], row i drawn with ``generators[i]``: [B]."""
        if self.sampling.greedy:
            return probs.argmax(dim=-1)
        return draw_rows(probs, generators)

    @property
    def drafter_free(self) -> bool:
        """Whether the stack drafts without a drafter (sjd): then the drafter, if one is
        given, is not used, and no planner sizes the trees."""
        return self.stack is not None and self.stack.drafter_free is not None

    @property
    def auto_tree(self) -> bool:
        """Whether the planner shapes the trees (an auto config); a method that brings its
        own tree (lantern++) gets the planner's tree config and may take its size.  A
        drafter-free method sizes its own trees."""
        return self.hooks is not None and self.tree_config.kind == "auto" and not self.drafter_free

    @property
    def own_tree(self) -> bool:
        """Whether a method of the stack brings its own tree (lantern++'s static trees)."""
        return self.hooks is not None and self.hooks.propose.owner is not None

    def planner(self, cost_model: CostModel | None = None, ar_fallback: bool | None = None) -> TreePlanner:
        """A fresh tree planner for one image (auto trees): each image adapts on its own, so
        an image does not depend on the images decoded before it or beside it in a batch.
        By default it plans with the engine's cost model (at its batch size) and tree config."""
        cost_model = cost_model or self.cost_model
        assert cost_model is not None and self.drafter is not None
        max_nodes = getattr(self.target, "max_tree_nodes", 128)
        max_fed = getattr(self.drafter, "max_tree_nodes", 128)
        fallback = self.tree_config.ar_fallback if ar_fallback is None else ar_fallback
        return TreePlanner(cost_model, max_nodes, max_fed, self.device, self.tree_config.sample, costs.scale_key(self.stack), fallback)

    @property
    def exact(self) -> bool:
        """Whether q_R is p at every step: a zero budget, or a stack that relaxes nothing
        (naive, sjd) whatever budget it was given.  Exact acceptance then rejects
        recursively, which accepts more than matching a sample of q_R."""
        assert self.stack is not None and self.hooks is not None
        return self.stack.delta == 0.0 or not self.hooks.relaxers

    def relaxers(self, tree: DraftTree, scores: Scores) -> list[tuple[str, float, Callable[..., Tensor | None]]]:
        """The stack's build_relaxed_dist hooks bound to one step: (method, delta, relax).
        For a batch, ``tree`` is a forest: a member that takes a batch relaxes it in one
        call, any other tree by tree."""
        assert self.hooks is not None

        def bind(hook: Callable[..., Tensor | None], tree: DraftTree, scores: Scores) -> Callable[..., Tensor | None]:
            return functools.partial(hook, target_dist=scores.probs, tree=tree, scores=scores, target=self.target, tokenizer=self.tokenizer)

        def bound(hook: MemberHook) -> Callable[..., Tensor | None]:
            if tree.images is None or hook.batch:
                return bind(hook, tree, scores)
            return relax.tree_by_tree([bind(hook, *one) for one in zip(tree.trees(), scores.split(tree.sizes))], tree.sizes)

        return [(r.method, r.delta, bound(r)) for r in self.hooks.relaxers]

    def relax(self, tree: DraftTree, scores: Scores) -> Tensor:
        """q_R [n, V] for one step: the stack's relaxations folded under its one budget (of
        one tree, or of a batch's forest: :meth:`relaxers`).  Where the step's programs are
        compiled, so is the fold of a top-k tree (a sampled tree's size changes from step
        to step), its contract verdicts read after it; a fold the compiler refuses (a
        member reads the host) runs eagerly from then on, and says so once."""
        assert self.stack is not None and self.hooks is not None
        members, stack_delta = self.relaxers(tree, scores), self.stack.delta
        if self.compiled and self._fold_compiles and not tree.sampled and stack_delta > 0 and members:
            try:
                dist, breaches = run(relax.fold_on_device, scores.probs, members, stack_delta, self.check_relax, self.stack.unbudgeted, compiled=True)
            except Refused as refusal:
                self._fold_compiles = False
                first_line = str(refusal).strip().splitlines()[0]
                warnings.warn(f"{self.stack.name}: its relaxation does not compile as one program ({first_line}); it runs eagerly", stacklevel=2)
            else:
                if breaches is not None:
                    relax.raise_breach([member.method for member in self.hooks.relaxers], breaches, stack_delta)
                return dist
        return relax.fold(scores.probs, members, stack_delta, check=self.check_relax, unbudgeted=self.stack.unbudgeted)

    def accept(self, tree: DraftTree, dist: Tensor, scores: Scores, generator: torch.Generator) -> Acceptance:
        """One step's acceptance by the stack's accept hook, else (no member implements
        it, or it passes) by the core's own rule (:func:`specimg.accept.accept_forest`,
        its device walk compiled where the step's programs are)."""
        result = self._method_accept(tree, dist, scores, generator)
        if result is None:
            result = acceptance.accept_forest(tree, [0], dist, scores.probs, self.sampling, self.exact, [generator], self.compiled)[0]
        return result

    def _method_accept(self, tree: DraftTree, dist: Tensor, scores: Scores, generator: torch.Generator) -> Acceptance | None:
        """The acceptance of the stack's member that implements ``accept``; None where none
        does or it passes."""
        assert self.hooks is not None
        if self.hooks.accept.owner is None:
            return None
        return self.hooks.accept(tree=tree, dist=dist, scores=scores, sampling=self.sampling, generator=generator, exact=self.exact,
                                 target=self.target)

    def _decode_speculative(self, lane: Lane) -> None:
        """One image's speculative steps; once its planner finds no tree that pays, the rest
        as AR steps (its lane booked them as one-node steps that accept nothing)."""
        assert self.hooks is not None
        while not lane.done:
            if lane.goes_ar:
                with Booking("verify", [lane]):
                    self._ar_alone(lane, lane.progress)
                break
            tree = lane.propose()
            with Booking("verify", [lane]):  # by the stack's score hook, else by the core's own
                scores = self.hooks.score(target=self.target, tree=tree, sampling=self.sampling, token_index=len(lane.tokens))
            with Booking("relax", [lane]):
                dist = self.relax(tree, scores)
            with Booking("accept", [lane]):
                result = self.accept(tree, dist, scores, lane.generator)
            walked = lane.walked(tree, scores, dist, result)
            with Booking("commit", [lane]):
                self.target.commit(walked.path)
                lane.advance(tree, scores, result, walked)
            lane.learn(tree, dist, result, walked)
        lane.close()
