"""The decode loop: prefill, then draft -> score -> relax -> accept -> commit per step."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor

from specimg import costs, relax
from specimg.config import Sampling, TreeConfig
from specimg.errors import SpecimgError
from specimg.graphs import CudaGraphs, step_mode
from specimg.methods import AR, Stack
from specimg.models.base import Condition, Drafter, Target, TargetOutput, draft_features, placed
from specimg.planner import Plan, TreePlanner
from specimg.plugins import PluginManager, get_plugin_manager
from specimg.sampling import cfg_active_at, probabilities
from specimg.stackhooks import StackHooks
from specimg.stats import ImageStats, RunStats
from specimg.step import Acceptance, Scores, Step
from specimg.tree import DraftSession, DraftTree


class Generation(NamedTuple):
    """Image tokens [images, tokens_per_image] and the statistics of the run."""

    tokens: Tensor
    stats: RunStats


class Engine:
    """Generates image tokens with a target, a drafter and a method stack.

    ``method`` is ``"ar"`` (plain autoregressive decoding) or a stack such as
    ``"cascade+lantern"``; ``options`` maps method names to option values; ``delta`` sets
    the stack's total-variation budget (default: the largest member delta).

    Everything runs on the target's device: ``device`` and ``dtype``, when given, move the
    models there first.  ``cuda_graphs``: "auto" replays the target's step forwards (and an
    EAGLE drafter's) as CUDA graphs when the target is on a GPU and has a fixed-shape step
    (LlamaGen), "on" insists, "off" runs them eagerly; off a GPU, "auto" leaves the models'
    step modes as they are.  An auto tree (the default) is chosen per step from
    ``cost_model``, measured on first use when not given (see :mod:`specimg.costs`).
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
        cost_model: costs.CostModel | None = None,
        cuda_graphs: CudaGraphs = "auto",
    ):
        if device is not None or dtype is not None:
            target, drafter, tokenizer = (placed(m, device, dtype) for m in (target, drafter, tokenizer))
        self.target, self.drafter, self.sampling, self.tree_config = target, drafter, sampling, tree
        self.tokenizer, self.cost_model = tokenizer, cost_model
        self.device = costs.device_of(target)
        self._set_step_mode(cuda_graphs)
        self.check_relax = relax.checks_enabled()
        self.on_step: Callable[[DraftTree, Tensor, list[int]], None] | None = None
        """Called after each speculative step with its tree, q_R and accepted path (tools that learn from a run)."""
        self.plugins = plugins or get_plugin_manager()
        self._check_vocabularies()
        self.stack: Stack | None = None
        self.hooks: StackHooks | None = None
        if method.strip() == AR:
            if options:
                raise SpecimgError("method 'ar' takes no options")
            return
        self.stack = self.plugins.stack(method, options, delta)
        if drafter is None and not self.drafter_free:
            raise SpecimgError(f"method {self.stack.name!r} drafts tokens and needs a drafter")
        self.hooks = StackHooks.bind(self.plugins, self.stack)
        if self.drafter_free and self.hooks.propose.owner != self.stack.drafter_free:
            raise SpecimgError(f"method {self.stack.drafter_free!r} drafts without a drafter but does not implement propose_tree")

    def _set_step_mode(self, cuda_graphs: CudaGraphs) -> None:
        """The target's step mode, and the drafter's alike when it has fixed-shape steps."""
        mode = step_mode(cuda_graphs, self.device, supported=hasattr(self.target, "set_step_mode"))
        if mode == "graphs" or cuda_graphs == "off":
            for model in (self.target, self.drafter):
                if hasattr(model, "set_step_mode"):
                    model.set_step_mode(mode)

    @property
    def method(self) -> str:
        return self.stack.name if self.stack else AR

    def _check_vocabularies(self) -> None:
        vocab = self.target.vocab_size
        for role, model in (("drafter", self.drafter), ("tokenizer", self.tokenizer)):
            size = getattr(model, "vocab_size", None)
            if size is not None and size != vocab:
                raise SpecimgError(f"the {role} has a vocabulary of {size} tokens, the target {vocab}")

    def generate(
        self, conditions: Sequence[Condition], seed: int = 0, progress: Callable[[int], None] | None = None
    ) -> Generation:
        """Generate one image per condition; image i uses seed ``seed + i``, so results do
        not depend on how the conditions are batched.  ``progress`` is called with each
        step's token count."""
        rows, stats = [], []
        if self.auto_tree and self.cost_model is None and conditions:
            self.cost_model = costs.for_engine(self, conditions[0])
        for index, condition in enumerate(conditions):
            generator = torch.Generator(self.device).manual_seed(seed + index)
            image = ImageStats()
            start = time.perf_counter()
            with torch.inference_mode():
                tokens = self._decode(condition, generator, image, progress)
            image.wall = time.perf_counter() - start
            rows.append(torch.tensor(tokens, dtype=torch.long))
            stats.append(image)
        return Generation(torch.stack(rows) if rows else torch.empty(0, self.target.num_tokens, dtype=torch.long), RunStats(tuple(stats)))

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

    @property
    def tree_label(self) -> str:
        """The tree this engine drafts, in words."""
        config = self.tree_config
        if self.hooks is None:
            return "-"
        if self.own_tree:
            return f"{self.hooks.propose.owner}'s own" + (", auto-sized" if self.auto_tree else "")
        if config.kind == "auto":
            return "auto"
        if config.kind == "dynamic":
            return f"depth {config.depth}, top-k {config.topk}, {config.total_tokens} nodes"
        return f"chain of {config.depth}" if config.kind == "chain" else f"static, {len(config.rank_paths)} paths"

    def planner(self) -> TreePlanner:
        """A fresh tree planner for one image (auto trees): each image adapts on its own, so
        an image does not depend on the images decoded before it."""
        assert self.cost_model is not None and self.drafter is not None
        max_nodes = getattr(self.target, "max_tree_nodes", 128)
        max_fed = getattr(self.drafter, "max_tree_nodes", 128)
        return TreePlanner(self.cost_model, max_nodes, max_fed, self.device, self.tree_config.sample, costs.scale_key(self.stack), self.tree_config.ar_fallback)

    def _sample(self, probs: Tensor, generator: torch.Generator) -> Tensor:
        """A token [1] drawn from ``probs`` [V], left on the device."""
        if self.sampling.greedy:
            return probs.argmax(dim=-1, keepdim=True)
        return torch.multinomial(probs, 1, generator=generator)

    def _draw(self, probs: Tensor, generator: torch.Generator) -> int:
        return int(self._sample(probs, generator))

    def _decode(self, condition: Condition, generator: torch.Generator, stats: ImageStats, progress: Callable[[int], None] | None) -> list[int]:
        target, sampling = self.target, self.sampling
        prefill = target.prefill(condition, sampling.cfg)
        stats.target_forwards = 1
        first = probabilities(prefill.logits, sampling)
        tokens = [self._draw(first[0], generator)]
        if progress:
            progress(1)
        if self.stack is None:
            self._decode_ar(tokens, generator, stats, progress)
        else:
            self._decode_speculative(condition, prefill, first, tokens, generator, stats, progress)
        stats.tokens = len(tokens)
        return tokens

    def _decode_ar(self, tokens: list[int], generator: torch.Generator, stats: ImageStats, progress: Callable[[int], None] | None) -> None:
        """The rest of the image one token per forward.  Each token stays on the device and
        feeds the next step; the host reads them all at the end, so no step waits for the
        device (on a GPU the host runs ahead and the launches overlap the work)."""
        target, sampling, device = self.target, self.sampling, self.device
        root = torch.zeros(1, dtype=torch.long, device=device)
        mask = torch.ones(1, 1, dtype=torch.bool, device=device)
        last, drawn = torch.tensor(tokens[-1:], device=device), []
        for index in range(len(tokens), target.num_tokens):
            out = target.forward_tree(last, root, mask)
            target.commit(root)
            last = self._sample(probabilities(out.logits, sampling, cfg_active_at(index, sampling))[0], generator)
            drawn.append(last)
            stats.target_forwards += 1
            if progress:
                progress(1)
        if drawn:
            tokens.extend(torch.cat(drawn).tolist())

    def relaxers(self, tree: DraftTree, scores: Scores) -> list[tuple[str, float, Callable[..., Tensor | None]]]:
        """The stack's build_relaxed_dist hooks bound to one step: (method, delta, relax)."""
        assert self.hooks is not None
        return [
            (r.method, r.delta, functools.partial(r, target_dist=scores.probs, tree=tree, scores=scores, target=self.target, tokenizer=self.tokenizer))
            for r in self.hooks.relaxers
        ]

    def relax(self, tree: DraftTree, scores: Scores) -> Tensor:
        """q_R [n, V] for one step: the stack's relaxations folded under its one budget."""
        assert self.stack is not None
        return relax.fold(scores.probs, self.relaxers(tree, scores), self.stack.delta, check=self.check_relax)

    def accept(self, tree: DraftTree, dist: Tensor, scores: Scores, generator: torch.Generator) -> Acceptance:
        """One step's acceptance by the stack's accept hook or the core's default."""
        assert self.stack is not None and self.hooks is not None
        return self.hooks.accept(tree=tree, dist=dist, scores=scores, sampling=self.sampling, generator=generator, exact=self.stack.delta == 0.0,
                                 target=self.target)

    @contextmanager
    def _timed(self, stats: ImageStats, phase: str):
        start = time.perf_counter()
        yield
        stats.seconds[phase] += time.perf_counter() - start

    def _decode_speculative(
        self,
        condition: Condition,
        prefill: TargetOutput,
        first: Tensor,
        tokens: list[int],
        generator: torch.Generator,
        stats: ImageStats,
        progress: Callable[[int], None] | None,
    ) -> None:
        assert self.hooks is not None
        target, sampling, device = self.target, self.sampling, self.device
        drafter = None if self.drafter_free else self.drafter
        planner = self.planner() if self.auto_tree else None
        if drafter is not None:
            drafter.prefill(condition, sampling.cfg)
            hidden = draft_features(drafter, prefill)
        root = DraftTree.from_tensors(torch.tensor(tokens[-1:], device=device), torch.tensor([-1], device=device),
                                      torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, device=device), width=0, height=0)
        previous = Step(root, Scores(first, prefill.hidden, prefill.logits, prefill.layers), Acceptance([0], tokens[-1]))  # the prefill as a step
        new_tokens = tokens[-1:]
        spent = torch.zeros((), dtype=torch.float64, device=device)  # TVD(q_R, p) over the walked paths' nodes
        while len(tokens) < target.num_tokens:
            if planner and planner.plan.is_ar:
                self._finish_ar(planner.plan, tokens, generator, stats, progress)
                break
            tree_config = planner.tree if planner else self.tree_config
            with self._timed(stats, "draft"):
                session = None
                if drafter is not None:
                    root_logits = drafter.start(hidden, torch.tensor(new_tokens, dtype=torch.long, device=device))
                    session = DraftSession(drafter, sampling, root_logits, len(tokens) - 1, filtered=tree_config.sample)
                tree = self.hooks.propose(
                    session=session, root_token=tokens[-1], tree_config=tree_config,
                    max_depth=target.num_tokens - len(tokens) - 1, previous=previous, sampling=sampling, generator=generator,
                )
            with self._timed(stats, "verify"):
                scores = self.hooks.score(target=target, tree=tree, sampling=sampling, token_index=len(tokens))
            with self._timed(stats, "relax"):
                dist = self.relax(tree, scores)
            with self._timed(stats, "accept"):
                result = self.accept(tree, dist, scores, generator)
            with self._timed(stats, "commit"):
                path = torch.tensor(result.path, dtype=torch.long, device=device)
                target.commit(path)
                new_tokens = tree.tokens[path[1:]].tolist() + [result.next_token]
                if drafter is not None:
                    hidden = draft_features(drafter, scores)[:, path]
                tokens.extend(new_tokens)
                previous = Step(tree, scores, result)
            if dist is not scores.probs:
                spent += relax.tvd(dist[path], scores.probs[path]).sum()
            if planner:
                self._plan_step(planner, stats, tree, dist, path)
            if self.on_step:
                self.on_step(tree, dist, result.path)
            stats.target_forwards += 1
            stats.tree_sizes.append(tree.size)
            stats.accepted.append(len(result.path) - 1)
            if progress:
                progress(len(new_tokens))
        stats.tvd = float(spent) / max(1, sum(stats.accepted) + len(stats.accepted))

    def _finish_ar(self, plan: Plan, tokens: list[int], generator: torch.Generator, stats: ImageStats, progress: Callable[[int], None] | None) -> None:
        """The rest of the image as AR steps (the planner found no tree that pays), booked
        as one-node steps that accept nothing.  The target has committed every token but
        the last, as after any step."""
        assert self.cost_model is not None
        steps = self.target.num_tokens - len(tokens)
        stats.trees.append([len(stats.accepted), plan.depth, plan.topk, plan.nodes])
        stats.predicted_ms += steps * plan.step_ms
        stats.predicted_ar_ms += steps * self.cost_model.ar_ms
        with self._timed(stats, "verify"):
            self._decode_ar(tokens, generator, stats, progress)
        stats.tree_sizes.extend([1] * steps)
        stats.accepted.extend([0] * steps)

    def _plan_step(self, planner: TreePlanner, stats: ImageStats, tree: DraftTree, dist: Tensor, path: Tensor) -> None:
        """Book the step against its plan's prediction, then let the planner learn from it."""
        assert self.cost_model is not None
        plan = planner.plan
        if not stats.trees or stats.trees[-1][1:] != [plan.depth, plan.topk, plan.nodes]:
            stats.trees.append([len(stats.accepted), plan.depth, plan.topk, plan.nodes])
        stats.predicted_ms += plan.step_ms
        stats.predicted_ar_ms += plan.tokens_per_step * self.cost_model.ar_ms
        planner.observe(tree, dist, path, self.sampling.greedy)
