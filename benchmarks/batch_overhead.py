"""Batched AR on the demo: time per step outside the target's forwards, by batch size.

    python benchmarks/batch_overhead.py --batch-sizes 1,8

One thread; each size decodes one warm-up batch, then one timed batch of B images, twice,
interleaved.  "outside" is the batch's wall time less the time inside the target's
forwards, per token step: the sampling (CFG, top-k, one draw per image) and the loop.
"""

from __future__ import annotations

import argparse
import time

import torch

from specimg.engine import Engine
from specimg.models.demo import demo_sampling, load_demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", type=lambda t: [int(x) for x in t.split(",")])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, sampling = load_demo().target, demo_sampling()
    inside = [0.0]
    for name in ("prefill", "forward_tree", "commit", "prefill_batch", "forward_batch"):
        forward = getattr(target, name)

        def timed(*a, _forward=forward, **k):
            start = time.perf_counter()
            out = _forward(*a, **k)
            inside[0] += time.perf_counter() - start
            return out

        setattr(target, name, timed)
    print("| round | batch size | wall s | in forwards s | outside, per step | outside, per image and step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for round_ in range(args.rounds):
        for size in args.batch_sizes:
            engine = Engine(target, method="ar", sampling=sampling, batch_size=size)
            labels = [i % 10 for i in range(size)]
            engine.generate(labels, seed=50)
            inside[0] = 0.0
            start = time.perf_counter()
            engine.generate(labels, seed=0)
            wall = time.perf_counter() - start
            outside = 1e6 * (wall - inside[0]) / target.num_tokens
            print(f"| {round_} | {size} | {wall:.2f} | {inside[0]:.2f} | {outside:.0f} us | {outside / size:.0f} us |")


if __name__ == "__main__":
    main()
