"""Whether a stack's calibration survives a machine that ran slower or faster when its cost
model's parts were timed.

    python benchmarks/calibration_drift.py --drift 1.0,1.35 --rounds 3

On a shared machine the same step takes a third longer one minute than the next, and the
parts of a cost model are timed once and cached.  A stack calibrated later, in another
minute, divides its real steps by parts from the first: its step scale, and every speedup
the planner predicts from it, carries the drift.  This script times the parts once, then
for each drift factor f multiplies every timing by f (parts timed in a minute f times
slower), calibrates each stack afresh on them and prints its step scale, the best tree
the planner predicts at the stack's measured acceptance with its predicted speedup, and
what the stack's engine then did against AR: the speed ratio (median of the rounds, each
round timing AR and the stack in turn, one thread, one process), tau and target forwards
an image.  A calibration that does not depend on when the parts were timed predicts the
same at every f.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from specimg import costs
from specimg.engine import Engine
from specimg.models.demo import demo_sampling, load_demo
from specimg.planner import choose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="naive,lantern,gsd,cascade,cascade+lantern")
    parser.add_argument("--drift", default="1.0,1.35", help="factors the timed parts are multiplied by")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--condition", type=int, default=3, help="the class every image draws")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["SPECIMG_CACHE_DIR"] = tempfile.mkdtemp(prefix="specimg-drift-")  # nothing read from or left in the user's cache
    models, sampling = load_demo(), demo_sampling()
    target, drafter, condition = models.target, models.drafter, args.condition
    key, machine = costs.cost_key(target, drafter, sampling)
    parts = costs.measure(target, drafter, sampling, condition, key, machine)
    path = costs.cache_dir() / "costs" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    ar = Engine(target, None, "ar", sampling=sampling)
    print(f"parts timed once: AR step {parts.ar_ms:.2f} ms, verify of 4 nodes {float(parts.verify(4)):.2f} ms; one thread; {os.getloadavg()[0]:.2f} load")
    print("| drift | method | step scale | best tree predicted | predicted | speed over AR | tau | forwards/image |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for factor in (float(f) for f in args.drift.split(",")):
        for method in args.methods.split(","):
            costs._memory.clear()
            path.write_text(parts.slower(factor).to_json())
            engine = Engine(target, drafter, method, sampling=sampling, tokenizer=models.tokenizer)
            model = engine.prepare(condition)
            assert model is not None and engine.stack is not None
            name = costs.scale_key(engine.stack)
            best = choose(model, np.array(model.acceptance[name]), max(n for n, _ in model.verify_ms), method=name)
            ratios = []
            for round_ in range(args.rounds):
                start = time.perf_counter()
                ar.generate([condition], seed=100 + round_)
                ar_s = time.perf_counter() - start
                start = time.perf_counter()
                stats = engine.generate([condition], seed=100 + round_).stats
                ratios.append(ar_s / (time.perf_counter() - start))
            print(f"| {factor:.2f} | {method} | {model.scale(name):.3f} | {best} | {best.speedup:.2f}x | {statistics.median(ratios):.2f}x | "
                  f"{stats.tau:.2f} | {stats.images[0].target_forwards} |")


if __name__ == "__main__":
    main()
