"""AR speed and the cost split of one verification step, for a GPT-B-shaped random target.

Prints AR tokens/s at batch 1 (CFG on, as LlamaGen samples), then for one tree size the
seconds per step in draft / verify / relax / accept / commit, and the engine's overhead:
everything that is not a target or drafter forward, as a share of the step.

    python benchmarks/engine_overhead.py [--preset GPT-B] [--tokens 64] [--tree 60]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import specimg
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target


class ForwardClock:
    """Wraps a model's forward methods and adds up the seconds spent inside them."""

    def __init__(self, model: object, methods: tuple[str, ...], seconds: dict[str, float]):
        for name in methods:
            original = getattr(model, name)

            def timed(*args, _original=original, _name=name, **kwargs):
                start = time.perf_counter()
                out = _original(*args, **kwargs)
                seconds[_name] += time.perf_counter() - start
                return out

            setattr(model, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="GPT-B")
    parser.add_argument("--tokens", type=int, default=64, help="image tokens (a square); 256 is LlamaGen at 256px")
    parser.add_argument("--tree", type=int, default=60, help="draft tree size (total_tokens)")
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = build_target(args.preset, block_size=args.tokens, seed=0)
    drafter = build_drafter(target, seed=1)
    sampling = specimg.Sampling(cfg_scale=4.0, top_k=2000)
    print(f"{args.preset} random weights, {args.tokens} tokens/image, CFG 4.0, {torch.get_num_threads()} threads, torch {torch.__version__}")

    ar = specimg.Engine(target, method="ar", sampling=sampling)
    ar.generate([0], seed=0)  # warm-up
    start = time.perf_counter()
    out = ar.generate(list(range(args.images)), seed=1)
    wall = time.perf_counter() - start
    print(f"AR: {out.stats.tokens / wall:.1f} tokens/s ({wall / args.images:.2f} s/image)")

    seconds: dict[str, float] = defaultdict(float)
    ForwardClock(target, ("forward_tree",), seconds)
    ForwardClock(drafter, ("start", "expand"), seconds)
    tree = specimg.TreeConfig(depth=6, topk=10, total_tokens=args.tree)
    engine = specimg.Engine(target, drafter, method="naive", sampling=sampling, tree=tree)
    engine.generate([0], seed=0)
    seconds.clear()
    out = engine.generate(list(range(args.images)), seed=1)
    steps = sum(len(s.accepted) for s in out.stats.images)
    phases = out.stats.seconds()
    step = sum(phases.values()) / steps
    model = sum(seconds.values()) / steps
    print(f"naive, tree of {args.tree} nodes: {steps} steps, mean tree {sum(sum(s.tree_sizes) for s in out.stats.images) / steps:.1f} nodes")
    for phase in specimg.stats.PHASES:
        print(f"  {phase:<7} {1000 * phases.get(phase, 0.0) / steps:8.2f} ms/step")
    print(f"  target forward {1000 * seconds['forward_tree'] / steps:.2f} ms, drafter forwards {1000 * (seconds['start'] + seconds['expand']) / steps:.2f} ms")
    print(f"engine overhead (step minus model forwards): {1000 * (step - model):.2f} ms/step = {100 * (step - model) / step:.1f}% of a step")


if __name__ == "__main__":
    main()
