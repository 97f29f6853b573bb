"""``specimg tune``: what auto trees see on this machine.

It reads (or measures) the cost model, learns a method's acceptance profile from a few
images drafted with a wide fixed tree, and ranks candidate trees by the planner's
expected tokens per second: the cost curve, the best tree of every shape, and a plot.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from specimg import costs, payoff, planner
from specimg.config import TreeConfig
from specimg.costmodel import CostModel
from specimg.engine import Engine
from specimg.files import atomic_path
from specimg.models.base import Condition
from specimg.profile import MAX_DEPTH, AcceptanceProfile

WIDE = TreeConfig(kind="dynamic", depth=MAX_DEPTH, topk=8, total_tokens=64)
"""The tree tune drafts with: wide and deep, so that the profile sees many ranks and depths."""


def tune(engine: Engine, conditions: Sequence[Condition], seed: int, out: str, echo: Callable[[str], None], remeasure: bool = False) -> dict[str, Any]:
    """Print the cost curve and the ranked candidate trees of ``engine`` (on auto trees);
    write OUT/tune.json and OUT/tune.png."""
    size = engine.batch_size
    if remeasure:
        costs.forget(engine.target, engine.drafter, engine.sampling, size)
    costs.load_or_measure(engine.target, engine.drafter, engine.sampling, conditions[0], log=echo, batch=size)
    cost = engine.prepare(conditions[0])  # with the method's step scale
    scale_name = costs.scale_key(engine.stack)
    profile = AcceptanceProfile(engine.device)  # pooled over one image per condition drafted with the wide tree
    engine.on_step = lambda tree, dist, path: profile.observe(tree, dist, path, engine.sampling.greedy)
    planned, engine.tree_config = engine.tree_config, WIDE
    try:
        engine.generate(list(conditions), seed=seed)
    finally:
        engine.on_step, engine.tree_config = None, planned
    rates = profile.rates()
    max_nodes = getattr(engine.target, "max_tree_nodes", 128)
    max_fed = getattr(engine.drafter, "max_tree_nodes", 128)
    ranked = sorted(planner.plans(cost, rates, max_nodes, max_fed=max_fed, method=scale_name), key=lambda p: -p.speedup)
    echo(f"cost model {cost.key}: {cost.machine}" + (f"; {size} images decoded together, each paying its share of a step" if size > 1 else ""))
    echo(
        f"AR step {cost.ar_ms:.2f} ms; drafter start {cost.draft_start_ms:.2f} ms; step overhead {cost.overhead_ms:.2f} ms; "
        f"a real {engine.method} step takes {cost.scale(scale_name):.2f}x its timed parts"
    )
    echo("verify:  " + "  ".join(f"{n}: {ms:.2f} ms ({ms / cost.ar_ms:.2f}x)" for n, ms in cost.verify_ms))
    echo("draft level by top-k:  " + "  ".join(f"{k}: {ms:.2f} ms" for k, ms in cost.draft_level_ms))
    echo(f"acceptance by rank (depth 0, {len(conditions)} images of {engine.method}): " + " ".join(f"{r:.2f}" for r in rates[0, :6]))
    echo("| depth | top-k | nodes | tokens/step | ms/step | predicted speedup |")
    echo("|---:|---:|---:|---:|---:|---:|")
    for plan in ranked[:12]:
        echo(f"| {plan.depth} | {plan.topk} | {plan.nodes} | {plan.tokens_per_step:.2f} | {plan.step_ms:.2f} | {plan.speedup:.2f}x |")
    best = planner.choose(cost, rates, max_nodes, max_fed=max_fed, method=scale_name)
    if best.speedup < 1.0 and engine.tree_config.ar_fallback:
        echo(f"auto would choose: AR for these images' pooled acceptance (no tree predicted to pay; the best, {best}, is predicted {best.speedup:.2f}x)")
    else:
        echo(f"auto would choose: {best} for these images' pooled acceptance (predicted {best.speedup:.2f}x)")
    picked = engine.generate(list(conditions), seed=seed).stats
    echo(
        f"generate on the same images and seeds (each image starts from the acceptance measured at calibration, then plans from its own steps): {picked.tree_shares()}; "
        f"tau {picked.tau:.2f}, predicted {picked.predicted_speedup:.2f}x"
    )
    for line in [payoff.measured(picked), *payoff.verdict(cost, picked, scale_name)]:
        echo(line)
    result = {
        "cost_model": json.loads(cost.to_json()), "method": engine.method, "rates": rates.tolist(),
        "candidates": [attrs.asdict(p) for p in ranked], "choice": attrs.asdict(best),
        "generate_trees": [{"depth": d, "topk": k, "nodes": n, "steps": steps, "tokens": tokens} for (d, k, n), (steps, tokens) in picked.tree_use().items()],
    }
    with atomic_path(os.path.join(out, "tune.json"), ".json") as tmp, open(tmp, "w") as file:
        json.dump(result, file, indent=1)
    if _plot(cost, rates, max_nodes, max_fed, scale_name, os.path.join(out, "tune.png")):
        echo(f"-> {out}/tune.json, {out}/tune.png")
    else:
        echo(f"-> {out}/tune.json (no tune.png: the plot needs matplotlib, pip install 'specimg[plot]')")
    return result


def _plot(cost: CostModel, rates: np.ndarray, max_nodes: int, max_fed: int, method: str, path: str) -> bool:
    """Left: the verify cost curve against the AR step; right: the predicted speedup of the
    best tree of each top-k against its size."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(11, 4.5), dpi=100, layout="constrained")
    left, right = fig.subplots(1, 2)
    nodes = np.arange(1, max_nodes + 1)
    left.plot(nodes, cost.verify(nodes), color="C0", label="verify (forward + probabilities)")
    left.scatter(*zip(*cost.verify_ms), color="C0", s=12, zorder=3)
    left.axhline(cost.ar_ms, linestyle="--", color="0.5", linewidth=1, label="one AR step")
    left.set_xlabel("tree nodes")
    left.set_ylabel("ms")
    left.set_title(f"cost curve: {cost.machine}", fontsize=9)
    left.legend()
    sizes = np.arange(2, max_nodes + 1)
    for i, topk in enumerate((1, 2, 4, 8)):
        best = np.full(sizes.shape, np.nan)
        for depth in range(1, min(MAX_DEPTH, 1 + max_fed // topk) + 1):
            tokens = planner.expected_tokens(rates, depth, topk)[1:max_nodes]
            speedup = tokens / cost.step(depth, topk, sizes[: tokens.size], method) * cost.ar_ms
            best[: tokens.size] = np.fmax(best[: tokens.size], speedup)
        right.plot(sizes, best, color=f"C{i}", label=f"top-k {topk}, best depth")
    right.axhline(1.0, linestyle="--", color="0.5", linewidth=1)
    right.set_xlabel("tree nodes")
    right.set_ylabel("predicted speedup vs AR (x)")
    right.set_title("expected tokens per second, relative to AR", fontsize=9)
    right.legend()
    for ax in (left, right):
        ax.grid(True, color="0.92")
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png")
    return True
