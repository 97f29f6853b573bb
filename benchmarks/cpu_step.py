"""The demo's CPU speed per image, this checkout against another (``git worktree add DIR
COMMIT``): is a change slower?

AR and naive on a fixed EAGLE-2 tree (no planner: every step drafts), each checkout with
its own defaults, one thread, the same seeds, each run in a fresh process, in rounds that
alternate the checkouts so that a shared machine's drifts fall on both; the median
seconds an image and its ratio to this checkout's.  (Eager against compiled in one
checkout: ``benchmarks/compile_cpu.py``.)

    python benchmarks/cpu_step.py ../old-main --images 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE_RUN = """
import json, sys, time, torch
torch.set_num_threads(1)
import specimg
from specimg.models.demo import load_demo
method, images = sys.argv[1], int(sys.argv[2])
models = load_demo()
tree = specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10)
engine = specimg.Engine(models.target, None if method == "ar" else models.drafter, method, tree=tree, tokenizer=models.tokenizer)
start = time.perf_counter(); engine.generate([0], seed=99); warm = time.perf_counter() - start
start = time.perf_counter(); out = engine.generate(list(range(images)), seed=0)
print(json.dumps({"s_per_image": (time.perf_counter() - start) / images, "warm_s": warm, "tau": out.stats.tau}))
"""


def once(checkout: str, method: str, images: int) -> dict[str, float]:
    """One run in a fresh process, importing specimg from ``checkout``."""
    env = {**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", ONE_RUN, method, str(images)], capture_output=True, text=True, env=env, cwd=checkout, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("against", help="another checkout of specimg")
    parser.add_argument("--methods", default="ar,naive")
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    variants = [here, os.path.abspath(args.against)]
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    for method in args.methods.split(","):
        times: dict[str, list[float]] = {v: [] for v in variants}
        warm: dict[str, float] = {}
        tau = {}
        for _ in range(args.rounds):
            for variant in variants:
                result = once(variant, method, args.images)
                times[variant].append(result["s_per_image"])
                warm[variant], tau[variant] = result["warm_s"], result["tau"]
        base = statistics.median(times[variants[0]])
        for variant in variants:
            name = "this checkout" if variant == here else variant
            median = statistics.median(times[variant])
            print(f"{method:6} {name:40} {median:7.2f} s/image  {median / base:5.2f}x  tau {tau[variant]:.2f}  "
                  f"(first image {warm[variant]:.1f} s)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
