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
"""

from __future__ import annotations

import argparse
import time

import torch

from specimg.config import TreeConfig
from specimg.engine import Engine
from specimg.models.demo import demo_sampling, load_demo
from specimg.models.eagle import DraftBatch, TreeDrafter
from specimg.models.llamagen import LlamaGenTarget

FORWARDS = {
    LlamaGenTarget: ("prefill", "forward_tree", "commit", "prefill_batch", "forward_batch", "forward_trees", "commit_trees"),
    TreeDrafter: ("prefill", "start", "expand"),
    DraftBatch: ("start", "expand"),
}


def time_forwards(inside: list[float]) -> None:
    """Add the time of every model forward to ``inside[0]`` (patched on the classes, so the
    drafter replicas of a batch are timed too)."""
    for cls, names in FORWARDS.items():
        for name in names:
            forward = getattr(cls, name)

            def timed(*a, _forward=forward, **k):
                start = time.perf_counter()
                out = _forward(*a, **k)
                inside[0] += time.perf_counter() - start
                return out

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
    args = parser.parse_args()
    torch.set_num_threads(1)
    models, sampling = load_demo(), demo_sampling()
    labels = [i % 10 for i in range(max(args.batch_sizes))]
    inside = [0.0]
    time_forwards(inside)
    alone = {}  # per method and size: the images of seeds 0, 1, ... decoded one at a time, planned alike
    print("| round | method | batch size | wall s | steps | in forwards s | outside, per step | outside, per image and step | tokens unlike alone |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for round_ in range(args.rounds):
        for method in args.methods:
            for size in args.batch_sizes:
                drafter = None if method == "ar" else models.drafter
                engine = Engine(models.target, drafter, method, sampling=sampling, tree=args.tree, tokenizer=models.tokenizer, batch_size=size)
                engine.generate(labels[:size], seed=50)
                inside[0] = 0.0
                start = time.perf_counter()
                result = engine.generate(labels[:size], seed=0)
                wall, forwards = time.perf_counter() - start, inside[0]
                steps = max(s.target_forwards for s in result.stats.images)
                outside = 1e6 * (wall - forwards) / steps
                if (method, size) not in alone:
                    one = Engine(models.target, drafter, method, sampling=sampling, tree=args.tree, tokenizer=models.tokenizer, cost_model=engine.cost_model)
                    alone[method, size] = torch.cat([one.generate([label], seed=i).tokens for i, label in enumerate(labels[:size])])
                differ = int((result.tokens != alone[method, size]).sum())
                print(f"| {round_} | {method} | {size} | {wall:.2f} | {steps} | {forwards:.2f} | {outside:.0f} us | {outside / size:.0f} us | {differ} of {result.tokens.numel()} |")


if __name__ == "__main__":
    main()
