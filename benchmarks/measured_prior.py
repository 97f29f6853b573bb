"""Auto trees planned from the stack's measured acceptance against the weak prior, and AR.

    python benchmarks/measured_prior.py --batch-size 8 --images 8 --rounds 12
    python benchmarks/measured_prior.py --batch-size 1 --images 2 --rounds 12

Each image's planner starts from the acceptance its stack measured when the cost model was
calibrated; before, it started from a weak guess and drafted its first steps to learn
whether a tree pays.  Both are run here side by side with AR on the demo: the "weak prior"
engines plan with the same cost model, its measured acceptance removed.  One thread,
one process, every engine once per round in turn; the speed over AR is the median of the
rounds' ratios (each against the AR run of its own round) and, in brackets, the least
time over the least, since on a shared machine other work only ever adds time.  tau and
the target forwards per image say what each engine did, whatever the timing noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import torch

from specimg.engine import Engine
from specimg.models.demo import demo_sampling, load_demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--images", type=int, default=8, help="images per engine and round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--methods", default="naive,cascade+lantern")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models, sampling = load_demo(), demo_sampling()
    conditions = [i % 10 for i in range(args.images)]
    engines = {"ar": Engine(models.target, None, "ar", sampling=sampling, batch_size=args.batch_size)}
    for method in args.methods.split(","):
        measured = Engine(models.target, models.drafter, method, sampling=sampling, batch_size=args.batch_size, tokenizer=models.tokenizer)
        cost = measured.prepare(conditions[0])
        assert cost is not None
        weak = Engine(models.target, models.drafter, method, sampling=sampling, batch_size=args.batch_size, tokenizer=models.tokenizer,
                      cost_model=attrs.evolve(cost, acceptance={}))
        engines[f"{method}, weak prior"] = weak
        engines[f"{method}, measured"] = measured
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    done = {}
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            done[name] = engine.generate(conditions, seed=1000 + round_ * args.images).stats
            seconds[name].append((time.perf_counter() - start) / args.images)
    print(f"B = {args.batch_size}, {args.images} images x {args.rounds} rounds, one thread")
    print("| engine | s/image, median (least) | speed over AR: median ratio (least/least) | tau | target forwards/image |")
    print("|---|---:|---:|---:|---:|")
    for name, times in seconds.items():
        ratios = [ar / t for ar, t in zip(seconds["ar"], times)]
        stats = done[name]
        print(
            f"| {name} | {statistics.median(times):.3f} ({min(times):.3f}) | {statistics.median(ratios):.2f}x ({min(seconds['ar']) / min(times):.2f}x) "
            f"| {stats.tau:.2f} | {stats.target_forwards / len(stats.images):.1f} |"
        )


if __name__ == "__main__":
    main()
