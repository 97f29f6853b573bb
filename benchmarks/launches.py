"""Kernel launches per decoding step on the graph path, counted on the CPU, by phase.

On a GPU a step is bound by launches (some 10-20 us each from Python, whatever their
size; a CUDA graph replays a forward as one).  This runs the demo as a GPU runs it (fixed
shapes, graph replays emulated, host reads in their device forms) and counts, per step
and phase, the ATen calls that would launch a kernel (:mod:`specimg.testing.launches`):
what drafting, relaxing and accepting cost a GPU step, measured without one.  With
``--batch-size B`` the images decode B at a time (one step serves B images): the table
gives launches per image-step, a batch step's launches over the images it advanced.

    python benchmarks/launches.py [--methods ar,naive,cascade,lantern,gsd,cascade+lantern] [--images 1] [--batch-size 1]
"""

from __future__ import annotations

import argparse

import torch

import specimg
from specimg.models.demo import demo_sampling, load_demo
from specimg.testing.launches import PHASES, LaunchCounter, graph_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,naive,cascade,lantern,gsd,cascade+lantern")
    parser.add_argument("--images", type=int, default=1, help="images decoded (classes 0-9 in turn)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = load_demo()
    tree = specimg.TreeConfig(kind="dynamic", depth=args.depth, topk=args.topk, total_tokens=args.nodes)
    counter = LaunchCounter()
    print(f"demo, fixed tree (depth {args.depth}, top-k {args.topk}, {args.nodes} nodes), {args.images} image(s) at batch size "
          f"{args.batch_size}: kernel launches per image-step on the graph path (a graph replay counts 1)\n")
    print("| method | tau | steps/image | " + " | ".join(PHASES) + " | total |")
    print("|---|---:|---:|" + "---:|" * (len(PHASES) + 1))
    with graph_path(counter, models.target, models.drafter):
        for method in args.methods.split(","):
            drafter = None if method == "ar" else models.drafter
            engine = specimg.Engine(models.target, drafter, method, sampling=demo_sampling(), tokenizer=models.tokenizer, tree=tree,
                                    batch_size=args.batch_size)
            engine.generate([0] * args.batch_size, seed=99)  # warm: the emulated graphs' buffers made
            counter.counts.clear()
            with counter:
                result = engine.generate([image % 10 for image in range(args.images)], seed=0)
            steps = sum(len(image.accepted) for image in result.stats.images) or result.stats.tokens
            per_step = [counter.counts[phase] / steps for phase in PHASES]
            print(f"| {method} | {result.stats.tau:.2f} | {steps / args.images:.0f} | " + " | ".join(f"{n:.0f}" for n in per_step)
                  + f" | {sum(per_step):.0f} |")


if __name__ == "__main__":
    main()
