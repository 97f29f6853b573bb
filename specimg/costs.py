"""Measuring the machine's cost model (:class:`specimg.costmodel.CostModel`).

Speculative decoding pays only when the tokens a step gains outweigh what the bigger
verify forward and the drafting cost, and both costs depend on the machine: a CPU core
pays for every node, a GPU verifies dozens for the price of one.  So the costs are
measured, not assumed: the target's verify step (forward of an n-node tree plus the
processing of its logits) for n from 1 to the cache's capacity, the drafter's start and
one level of growth per frontier width, and one AR step.  A few seconds, once per models
and machine (:func:`cost_key`), then cached on disk as JSON under :func:`specimg.cache.cache_dir`.
Runs that share a cost model choose the same trees, so the same seed gives the same images.  A cached file is checked before use: anything but
finite, positive timings in well-formed tables is measured again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import attrs
import numpy as np
import torch
from torch import Tensor

from specimg.accept import walk_forest
from specimg.cache import cache_dir
from specimg.compiled import compiles, run
from specimg.config import Sampling
from specimg.costmodel import LEVEL_WIDTHS, VERIFY_SIZES, CostModel, _chances
from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.methods import AR, Stack
from specimg.models.base import BatchTrees, Condition, Drafter, Target, draft_features
from specimg.profile import AcceptanceProfile
from specimg.sampling import draw_rows, probabilities
from specimg.tree import DraftSession, DraftTree, build_dynamic, stack_trees

_REPEATS, _WARMUP = 5, 2
_START_TOKENS = 3
_MIN_LEVEL_MS = 1e-3  # a level of drafting never costs nothing, however the noise falls
_memory: dict[str, CostModel] = {}


def device_of(target: Target) -> torch.device:
    return target.input_embeddings().device


def _describe(model: Any) -> dict[str, Any]:
    """What a model's speed depends on: its class, config and parameter shapes and dtype."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": repr(getattr(model, "config", None)),
        "vocab": getattr(model, "vocab_size", None),
        "params": [list(p.shape) for p in params],
        "dtype": str(params[0].dtype) if params else None,
    }


@functools.cache
def _cpu_name() -> str:
    """The CPU's model: /proc/cpuinfo's name on Linux, where platform.processor() often
    says only the architecture; that, or the machine type, elsewhere."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as file:
        for line in file:
            field, _, value = line.partition(":")
            if field.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown cpu"


def _hardware(device: torch.device) -> str:
    """The processors a timing depends on, in words: the CPU's model and cores, and on
    CUDA the GPU, its compute capability and the CUDA runtime besides the host CPU that
    launches its work."""
    cpu = f"{_cpu_name()}, {os.cpu_count()} cpus"
    if device.type != "cuda":
        return cpu
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}, CUDA {torch.version.cuda}; host {cpu}"


def cost_key(target: Target, drafter: Drafter, sampling: Sampling, batch: int = 1) -> tuple[str, str]:
    """(key, machine): a hash of everything the timings depend on, the batch size
    included, and a readable description of the machine part."""
    device = device_of(target)
    machine = f"{device.type} ({_hardware(device)}), {torch.get_num_threads()} threads, {target.input_embeddings().dtype}, torch {torch.__version__}"
    parts = {
        "target": _describe(target), "drafter": _describe(drafter), "machine": machine,
        "cfg": sampling.cfg, "top_k": sampling.top_k > 0, "top_p": sampling.top_p < 1.0,
        "capacity": [getattr(target, "max_tree_nodes", None), getattr(drafter, "max_tree_nodes", None)],  # the verify sizes measured
        "scales": "relative to AR",  # files whose step scales were not (step_scale) are measured again
    }
    mode = getattr(target, "step_mode", "eager")
    if mode != "eager":  # fixed-shape steps cost otherwise; eager keys stay as they were
        parts["step"] = mode
    if batch > 1:  # one image at a time keeps the keys it had
        parts["batch"] = batch
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16], machine


def scale_key(stack: Stack | None) -> str:
    """The name a method stack's step scale is kept under: its methods, budget and resolved
    options (a relaxation's cost may depend on them), e.g.
    ``cascade {"delta":0.1,"options":{"cascade":{...}}}``; ``ar`` without a stack."""
    if stack is None:
        return AR
    settings = {"delta": stack.delta, "options": stack.options_dict()}
    return f"{stack.name} {json.dumps(settings, sort_keys=True, separators=(',', ':'), default=repr)}"


def load_or_measure(target: Target, drafter: Drafter, sampling: Sampling, condition: Condition, log: Callable[[str], None] | None = None,
                    batch: int = 1) -> CostModel:
    """The cached cost model for these models on this machine at this batch size,
    measured if there is none."""
    key, machine = cost_key(target, drafter, sampling, batch)
    if key in _memory:
        return _memory[key]
    path = cache_dir() / "costs" / f"{key}.json"
    try:
        model = CostModel.from_json(path.read_text())
        if model.key != key:
            raise ValueError(f"{path} holds the cost model {model.key}")
    except (OSError, ValueError):  # missing, unreadable or corrupt (from_json checks it all): measure again
        if log:
            log(f"measuring the cost model for {machine} (once; cached as {key})")
        return _keep(measure(target, drafter, sampling, condition, key, machine, batch))
    _memory[key] = model
    return model


def step_scale(wall_s: float, predicted_ms: float, ar_wall_s: float, ar_predicted_ms: float) -> float:
    """A stack's step scale from its calibration: how much longer its real steps took than
    the timed parts predict (``wall_s`` against ``predicted_ms``), relative to the same
    ratio for AR steps decoded beside them.  Relative, because a shared machine runs
    faster or slower from one minute to the next: a ratio of two decodes made together
    does not depend on when the parts were timed, and AR's real steps carry loop work its
    timed part does not, as the stack's do.  The planner's predicted speedups are then
    real speed against real AR speed."""
    if predicted_ms <= 0 or ar_predicted_ms <= 0 or ar_wall_s <= 0:
        return 1.0
    return (1000 * wall_s / predicted_ms) / (1000 * ar_wall_s / ar_predicted_ms)


def with_calibration(model: CostModel, name: str, scale: float, rates: np.ndarray) -> CostModel:
    """``model`` with the step scale and acceptance ``rates`` of the method stack ``name``
    (:func:`scale_key`), kept in memory and in the cache file (see
    :meth:`specimg.engine.Engine.prepare`)."""
    return _keep(attrs.evolve(model, step_scales={**model.step_scales, name: scale}, acceptance={**model.acceptance, name: _chances(rates.tolist())}))


def forget(target: Target, drafter: Drafter, sampling: Sampling, batch: int = 1) -> None:
    """Drop the cached cost model of these models on this machine: the next use measures."""
    key, _ = cost_key(target, drafter, sampling, batch)
    _memory.pop(key, None)
    (cache_dir() / "costs" / f"{key}.json").unlink(missing_ok=True)


def _keep(model: CostModel) -> CostModel:
    """``model``, kept in memory and in its cache file (a read-only cache only costs a new measurement next time)."""
    _memory[model.key] = model
    with contextlib.suppress(OSError), atomic_path(cache_dir() / "costs" / f"{model.key}.json", ".json") as tmp, open(tmp, "w") as file:
        file.write(model.to_json())
    return model


def _timed(device: torch.device, call: Callable[..., Any], repeats: int = _REPEATS, setup: Callable[[], Any] | None = None) -> float:
    """Median milliseconds of a call, after warm-up; waits for the device each time.  The
    median, not the minimum: a decode step pays what a call typically costs, which the
    fastest of a tight loop of identical calls underestimates on a CPU.  ``setup`` runs
    untimed before each call and hands it its argument."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = []
    for i in range(_WARMUP + repeats):
        arg = setup() if setup else None
        sync()
        start = time.perf_counter()
        call(arg) if setup else call()
        sync()
        if i >= _WARMUP:
            samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


@torch.inference_mode()
def measure(target: Target, drafter: Drafter, sampling: Sampling, condition: Condition, key: str = "", machine: str = "", batch: int = 1) -> CostModel:
    """Time the step's parts; the verify forwards at a prefix of half an image, since
    attention cost grows with it.  Nothing timed advances a cache for good, so any image
    size leaves room.  At a batch size above 1 the verify and AR timings are an image's
    share of a forward over ``batch`` images, each with the tree (the drafting and the
    rest of a step are each image's own, as in a batch)."""
    device = device_of(target)
    timed = functools.partial(_timed, device)
    capacity = min(getattr(target, "max_tree_nodes", VERIFY_SIZES[-1]), getattr(drafter, "max_tree_nodes", VERIFY_SIZES[-1]))
    prefill = target.prefill(condition, sampling.cfg)
    token = torch.zeros(1, dtype=torch.long, device=device)
    last = draft_features(drafter, prefill)
    for _ in range(target.num_tokens // 2):  # one token at a time, as AR decodes it
        last = draft_features(drafter, target.forward_tree(token, token, torch.ones(1, 1, dtype=torch.bool, device=device)))
        target.commit(token)
    sizes = [n for n in VERIFY_SIZES if n <= capacity]
    trees = {n: DraftTree.from_parents([0] * n, [-1] + [(i - 1) // 4 for i in range(1, n)]) for n in sizes}
    ar, verify = _verify_times(target, sampling, condition, trees, timed, batch)
    news = torch.zeros(_START_TOKENS, dtype=torch.long, device=device)
    start = timed(lambda _: drafter.start(last.expand(-1, _START_TOKENS, -1), news), setup=lambda: drafter.prefill(condition, sampling.cfg))
    overhead = _step_overhead(target, sampling, condition, device, timed)
    base, levels = [], []
    for width in LEVEL_WIDTHS:

        def fresh_root() -> torch.Tensor:  # a reset drafter: its node budget must not run out
            drafter.prefill(condition, sampling.cfg)
            return drafter.start(draft_features(drafter, prefill), token)

        def draft(root: torch.Tensor, depth: int) -> DraftTree:
            session = DraftSession(drafter, sampling, root, 0, filtered=False)
            return build_dynamic(session, 0, depth, width, 1 + depth * width * width)

        shallow, deep = (timed(lambda root, d=depth: draft(root, d), setup=fresh_root) for depth in (1, 3))
        base.append((width, shallow))
        levels.append((width, max(_MIN_LEVEL_MS, (deep - shallow) / 2)))
    return CostModel(key, machine, _monotone(verify), _monotone(base), _monotone(levels), start, overhead, ar)


def _verify_times(target: Target, sampling: Sampling, condition: Condition, trees: Mapping[int, DraftTree], timed: Callable[..., float], batch: int) -> tuple[float, list[tuple[int, float]]]:
    """The median ms of one AR step (a one-node tree's verify and a draw) and of the verify
    of each tree, each as the engine runs it (its distributions compiled where the
    target's steps are), per image (see ``measure``); a batch first makes half an image of
    batched AR steps.  Nothing is committed, so the prefix stays put; the commit's cost is
    in the overhead."""
    device = device_of(target)
    if batch == 1:
        on_device = {n: attrs.evolve(tree, **{f: getattr(tree, f).to(device) for f in ("tokens", "depths", "mask")}) for n, tree in trees.items()}

        def logits(n: int) -> Tensor:
            return target.forward_tree(on_device[n].tokens, on_device[n].depths, on_device[n].mask).logits
    else:
        if not isinstance(target, BatchTrees):
            raise SpecimgError(f"a cost model at batch size {batch} needs a target that verifies a batch of trees")
        target.prefill_batch([condition] * batch, sampling.cfg, tree_nodes=max(trees))
        roots = torch.zeros(batch, dtype=torch.long, device=device)
        for _ in range(target.num_tokens // 2):
            target.forward_batch(roots)
        stacked = {n: tuple(t.to(device) for t in stack_trees([tree] * batch)) for n, tree in trees.items()}
        nodes = {n: torch.arange(batch * n, device=device) for n in trees}

        def logits(n: int) -> Tensor:  # the logits of every image's nodes
            return cast(BatchTrees, target).forward_trees(*stacked[n]).logits.flatten(1, 2)[:, nodes[n]]

    compiled = compiles(target)

    def verify(n: int) -> Tensor:
        return run(probabilities, logits(n), sampling, True, compiled=compiled)

    def ar_step() -> None:  # one draw per image, as the AR loop draws
        draw_rows(verify(1), [None] * batch)

    # timed in rounds over AR and every size: a burst of load spoils one round, not one size
    rounds: dict[Any, list[float]] = {key: [] for key in ["ar", *trees]}
    for _ in range(_REPEATS):
        rounds["ar"].append(timed(ar_step, repeats=1) / batch)
        for n in trees:
            rounds[n].append(timed(lambda n=n: verify(n), repeats=1) / batch)
    ar = statistics.median(rounds.pop("ar"))
    return ar, [(n, statistics.median(ms)) for n, ms in rounds.items()]


def _step_overhead(target: Target, sampling: Sampling, condition: Condition, device: torch.device, timed: Callable[..., float]) -> float:
    """The median ms of a step's work besides drafting and verifying, on an 8-node chain
    whose first three drafts are accepted: the walk (compiled where the target's steps
    are, as the engine's), the commit and the planner's observation; each call's setup
    restarts the image and verifies the chain, untimed."""
    chain = DraftTree.from_parents([0] * 8, [-1, *range(7)])
    tree = attrs.evolve(chain, **{f: getattr(chain, f).to(device) for f in ("tokens", "parents", "depths", "mask", "logprobs", "child_ids")})
    dist = torch.zeros(8, target.vocab_size, device=device)
    dist[:3, 0] = 1.0  # token 0 at depths 0-2: three accepted
    dist[3:, 1] = 1.0
    profile = AcceptanceProfile(device)
    generator = torch.Generator(device).manual_seed(0)
    compiled = compiles(target)

    def verify() -> None:
        target.prefill(condition, sampling.cfg)
        target.forward_tree(tree.tokens, tree.depths, tree.mask)

    def rest(_: Any) -> None:
        result = walk_forest(tree, [0], dist, [generator], compiled)[0]
        path = torch.tensor(result.path, device=device)
        target.commit(path)
        tree.tokens[path[1:]].tolist()
        profile.observe(tree, dist, result.path, sampling.greedy)

    return timed(rest, setup=verify)


def _monotone(table: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """A bigger call never costs less: a spike is replaced by what a larger size cost."""
    sizes, ms = zip(*table)
    return tuple(zip(sizes, np.minimum.accumulate(np.array(ms)[::-1])[::-1].tolist()))
