"""The demo on the CPU, eager (``--compile off``) against compiled (``--compile on``:
inductor's C++), for AR and naive on a fixed tree: which step mode ``--compile auto``
should pick on a CPU.

Each (method, mode) gets its own models (a step mode is the model's) and one warm-up
image, which compiles; then ``--rounds`` rounds decode one image each, the engines
interleaved, so a shared machine's load falls on both modes alike.  Per round it prints
the seconds of each image and the seconds the image spent compiling (a recompile for a
shape not met before), then the ratios eager / compiled.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compile_cpu.py [--rounds 4] [--tree 2,3,6]
"""

from __future__ import annotations

import argparse
import time

import torch

import specimg
from specimg.compiled import CompileClock
from specimg.models import loading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tree", default="2,3,6", help="naive's fixed tree: depth,topk,total_tokens")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    depth, topk, total = (int(x) for x in args.tree.split(","))
    tree = specimg.TreeConfig(kind="dynamic", depth=depth, topk=topk, total_tokens=total)
    engines = {}
    for method in ("ar", "naive"):
        for mode in ("off", "on"):
            models = loading.built_in("demo")
            engine = specimg.Engine(models.target, None if method == "ar" else models.drafter, method, tokenizer=models.tokenizer, tree=tree,
                                    compile=mode)
            compiling, begin = CompileClock.seconds, time.perf_counter()
            engine.generate([0], seed=0)
            print(f"{method} --compile {mode}: warm-up image {time.perf_counter() - begin:.1f} s, of which compiling "
                  f"{CompileClock.seconds - compiling:.1f} s", flush=True)
            engines[method, mode] = engine
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
    for round_ in range(args.rounds):
        line = []
        for (method, mode), engine in engines.items():
            compiling, begin = CompileClock.seconds, time.perf_counter()
            result = engine.generate([round_ + 1], seed=round_ + 1)
            seconds[method, mode].append(time.perf_counter() - begin)
            line.append(f"{method}/{mode} {seconds[method, mode][-1]:.2f} s (compiling {CompileClock.seconds - compiling:.1f}, tau {result.stats.tau:.2f})")
        print(f"round {round_}: " + "; ".join(line), flush=True)
    for method in ("ar", "naive"):
        off, on = seconds[method, "off"], seconds[method, "on"]
        print(f"{method}: eager / compiled per round " + " ".join(f"{a / b:.2f}" for a, b in zip(off, on))
              + f"; least time eager {min(off):.2f} s, compiled {min(on):.2f} s")


if __name__ == "__main__":
    main()
