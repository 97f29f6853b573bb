"""Batched decoding on the demo: time per step outside the models' forwards, by batch size.

    python benchmarks/batch_overhead.py --batch-sizes 1,8 --methods ar,naive
    python benchmarks/batch_overhead.py --methods naive,cascade+lantern --tree 2,3,6

One thread; each (method, size) decodes one warm-up batch, then one timed batch of B
images, for ``--rounds`` rounds, interleaved.  A step is one target forward for the whole
batch (AR: one per token; speculative: as many as the batch's slowest image needs).
"outside" is the batch's wall time less the time inside the target's and the drafter's
forwards, per step: sampling, tree building, relaxation, acceptance and the loop.  The
last column counts the tokens that differ from the same images decoded one at a time
with the same cost model (auto trees plan with the model measured at the batch size, so
a relaxed method's images at another size differ by their plans, not by rounding).
Auto trees send most steps to AR on a CPU; ``--tree DEPTH,TOPK,NODES`` drafts fixed
EAGLE-2 trees instead, so that every step drafts, relaxes and accepts.

``--split`` decodes each timed batch a second time (same seeds, so the same steps) with
every torch operation outside the forwards timed (a TorchFunctionMode around each call),
and splits that pass's time outside the forwards into the operations' time and the rest:
the Python of the loop, which is what must not grow with the batch.  The mode's own cost
per operation it times and per attribute read it passes on (``.shape``) is measured
first (a loop of cheap operations with the mode, less the same loop without it) and
taken off the Python.  Operations and Python come from one pass, so the operations'
run-to-run spread (hundreds of microseconds at B = 8) cancels.  The operations' time
grows with the rows they touch (top-k over the vocabulary, the draws) and is arithmetic
a GPU runs asynchronously; their count per step is what a GPU pays in launches.  Two
more passes count the Python run outside the forwards on the main thread: its function
calls (a profile hook) and its bytecode instructions (a trace hook), the same on every
run, so they show whether a step's Python grows with the batch where the time is too
noisy to say.  Calls weigh every call alike; instructions also count the loops over a
batch's rows that make no call.

On a shared machine other work only ever adds time, so the closing table takes, per
method and batch size, the least of the rounds (each figure on its own), and gives the
Python time and calls per step of each batch size over those of the smallest.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from specimg.config import TreeConfig
from specimg.engine import Engine
from specimg.models.demo import demo_sampling, load_demo
from specimg.testing.calls import MODEL_FORWARDS, BytecodeCount, CallCount


class Clock:
    """Time spent inside the models' forwards (``depth``: how deep in them the decode is),
    and, while an :class:`OpClock` is on, the time and number of torch operations called
    outside them."""

    def __init__(self) -> None:
        self.depth = 0
        self.reset()

    def reset(self) -> None:
        self.forwards = self.ops_time = 0.0
        self.ops = self.reads = 0


class OpClock(TorchFunctionMode):
    """Times each torch operation called outside a forward."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.clock.depth:
            return func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "__get__":  # reading an attribute (.shape): no operation
            self.clock.reads += 1
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.clock.ops_time += time.perf_counter() - start
        self.clock.ops += 1
        return out


def mode_overhead(repeats: int = 20000, trials: int = 5) -> tuple[float, float]:
    """What an :class:`OpClock` adds (s) per operation it times and per attribute read it
    passes on: the least over ``trials`` of a loop with the mode less the same loop
    without it."""
    x = torch.zeros(8)

    def operations() -> None:
        for _ in range(repeats):
            x.add(1)

    def reads() -> None:
        for _ in range(repeats):
            x.shape  # noqa: B018 -- the read is what is timed

    def added(loop: Any) -> float:
        best = float("inf")
        for _ in range(trials):
            start = time.perf_counter()
            loop()
            plain = time.perf_counter() - start
            with OpClock(Clock()):
                start = time.perf_counter()
                loop()
                moded = time.perf_counter() - start
            best = min(best, moded - plain)
        return best / repeats

    return added(operations), added(reads)


def time_forwards(clock: Clock) -> None:
    """Add the time of every model forward to ``clock.forwards`` (patched on the classes,
    so the drafter replicas of a batch are timed too)."""
    for cls, names in MODEL_FORWARDS.items():
        for name in names:
            forward = getattr(cls, name)

            def timed(*a, _forward=forward, **k):
                clock.depth += 1
                start = time.perf_counter()
                try:
                    return _forward(*a, **k)
                finally:
                    if clock.depth == 1:
                        clock.forwards += time.perf_counter() - start
                    clock.depth -= 1

            setattr(cls, name, timed)


def fixed_tree(text: str) -> TreeConfig:
    depth, topk, nodes = map(int, text.split(","))
    return TreeConfig(depth=depth, topk=topk, total_tokens=nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", type=lambda t: [int(x) for x in t.split(",")])
    parser.add_argument("--methods", default="ar,naive", type=lambda t: t.split(","))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tree", type=fixed_tree, default=TreeConfig(), help="DEPTH,TOPK,NODES (default: auto)")
    parser.add_argument("--split", action="store_true", help="split the time outside the forwards into torch operations and Python")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models, sampling = load_demo(), demo_sampling()
    per_op, per_read = mode_overhead() if args.split else (0.0, 0.0)
    if args.split:
        print(f"The timing mode's own cost, taken off the Python: {1e6 * per_op:.2f} us per operation, {1e6 * per_read:.2f} us per attribute read\n")
    labels = [i % 10 for i in range(max(args.batch_sizes))]
    clock = Clock()
    time_forwards(clock)
    alone = {}  # per method and size: the images of seeds 0, 1, ... decoded one at a time, planned alike
    best: dict[tuple[str, int], dict[str, float]] = {}  # per method and size: the least of the rounds
    split = " torch ops, per step | ops per step | Python, per step |" if args.split else ""
    print(f"| round | method | batch size | wall s | steps | in forwards s | outside, per step | outside, per image and step |{split} tokens unlike alone |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (4 if args.split else 1))
    for round_ in range(args.rounds):
        for method in args.methods:
            for size in args.batch_sizes:
                drafter = None if method == "ar" else models.drafter
                engine = Engine(models.target, drafter, method, sampling=sampling, tree=args.tree, tokenizer=models.tokenizer, batch_size=size)
                engine.generate(labels[:size], seed=50)
                clock.reset()
                start = time.perf_counter()
                result = engine.generate(labels[:size], seed=0)
                wall, forwards = time.perf_counter() - start, clock.forwards
                steps = max(s.target_forwards for s in result.stats.images)
                outside = 1e6 * (wall - forwards) / steps
                ops = python = calls = instructions = 0.0
                if args.split:  # the same batch again (same seeds, same steps), its operations timed, then its calls and instructions counted
                    clock.reset()
                    start = time.perf_counter()
                    with OpClock(clock):
                        engine.generate(labels[:size], seed=0)
                    timed = time.perf_counter() - start - clock.forwards
                    mode = clock.ops * per_op + clock.reads * per_read
                    ops, python = 1e6 * clock.ops_time / steps, 1e6 * (timed - clock.ops_time - mode) / steps
                    with CallCount() as counted:
                        engine.generate(labels[:size], seed=0)
                    calls = counted.calls / steps
                    with BytecodeCount() as traced:
                        engine.generate(labels[:size], seed=0)
                    instructions = traced.instructions / steps
                split = f" {ops:.0f} us | {clock.ops / steps:.0f} | {python:.0f} us |" if args.split else ""
                least = best.setdefault((method, size), {"outside": outside, "ops": ops, "count": clock.ops / steps, "python": python, "calls": calls, "instructions": instructions})
                least.update(outside=min(least["outside"], outside), ops=min(least["ops"], ops), python=min(least["python"], python))
                if (method, size) not in alone:
                    one = Engine(models.target, drafter, method, sampling=sampling, tree=args.tree, tokenizer=models.tokenizer, cost_model=engine.cost_model)
                    alone[method, size] = torch.cat([one.generate([label], seed=i).tokens for i, label in enumerate(labels[:size])])
                differ = int((result.tokens != alone[method, size]).sum())
                print(f"| {round_} | {method} | {size} | {wall:.2f} | {steps} | {forwards:.2f} | {outside:.0f} us | {outside / size:.0f} us |{split} {differ} of {result.tokens.numel()} |")
    summary(best, args.batch_sizes, args.rounds, args.split)


def summary(best: dict[tuple[str, int], dict[str, float]], sizes: list[int], rounds: int, split: bool) -> None:
    """The least of the rounds per method and batch size; with ``split``, the Python time a
    step (the split pass's time outside the forwards less its operations and the mode's
    own cost), and the Python calls and bytecode instructions a step, each over the
    smallest batch size's."""
    print(f"\nLeast of {rounds} rounds, per step:\n")
    low = min(sizes)
    print("| method | batch size | outside |" + (f" torch ops | ops | Python | over B = {low} | Python calls | over B = {low} | instructions | over B = {low} |" if split else ""))
    print("|---|---:|---:|" + ("---:|" * 8 if split else ""))
    for (method, size), least in best.items():
        row = f"| {method} | {size} | {least['outside']:.0f} us |"
        if split:
            base = best[method, low]
            row += (f" {least['ops']:.0f} us | {least['count']:.0f} | {least['python']:.0f} us | {least['python'] / base['python']:.2f}x |"
                    f" {least['calls']:.0f} | {least['calls'] / base['calls']:.2f}x | {least['instructions']:.0f} | {least['instructions'] / base['instructions']:.2f}x |")
        print(row)


if __name__ == "__main__":
    main()
