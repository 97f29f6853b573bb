"""The engine on a GPU: AR speed, the verify cost curve, the tree auto mode picks, and the
engine's ceiling, for LlamaGen-shaped random-weight targets with an EAGLE-1 drafter.

Per preset (GPT-B and GPT-XL shapes by default, bf16, 256 image tokens, CFG 4):

- AR tokens/s (batch 1, one image at a time, as the engine decodes);
- the cost model: verify time of trees of 1..128 nodes, drafting time per level, and the
  tree the planner picks for a typical image profile (rank-r child accepted with
  0.6 * 0.45**r at every depth, about what the demo's EAGLE-1 drafter reaches);
- naive with an oracle drafter that drafts the target's own greedy tokens, on auto trees:
  every draft is accepted, so its speedup is the most this engine can give on this
  machine, and its gap to the cost model's prediction is the engine's own overhead.

    python benchmarks/gpu.py                       # cuda, bfloat16, GPT-B and GPT-XL
    python benchmarks/gpu.py --device cpu --dtype float32 --presets GPT-B --tokens 64 --images 1   # a smoke run

Random weights: the timings are those of real checkpoints of the same shape; the
acceptance is not (see the oracle).  Prints everything; writes nothing.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import specimg
from specimg import costs, planner
from specimg.models.base import cfg_rows
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target

TYPICAL = np.array([[0.6 * 0.45**r for r in range(planner.MAX_TOPK)]] * planner.MAX_DEPTH)


class GreedyOracle:
    """A drafter that knows the target's greedy tokens for the image being decoded: its
    logits put all mass on the token the target will pick at each position."""

    def __init__(self, vocab_size: int, tokens: torch.Tensor):
        self.vocab_size, self.tokens = vocab_size, tokens
        self.max_tree_nodes = 128

    def prefill(self, condition, cfg: bool) -> None:
        self.rows, self.committed = cfg_rows(cfg), 0

    def _logits(self, depths: torch.Tensor) -> torch.Tensor:
        index = (self.committed + depths).clamp(max=self.tokens.numel() - 1)
        out = torch.full((self.rows, depths.numel(), self.vocab_size), -30.0, device=self.tokens.device)
        out[:, torch.arange(depths.numel(), device=self.tokens.device), self.tokens[index]] = 30.0
        return out

    def start(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        self.committed += tokens.numel()
        self.depths = torch.zeros(1, dtype=torch.long, device=self.tokens.device)
        return self._logits(self.depths)[:, 0]

    def expand(self, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        depths = self.depths[parents.to(self.depths.device)] + 1
        self.depths = torch.cat([self.depths, depths])
        return self._logits(depths)


def timed(device: torch.device, run) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def bench_preset(preset: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    target = build_target(preset, block_size=args.tokens, seed=0).to(device=device, dtype=dtype)
    drafter = build_drafter(target, seed=1)
    sampling = specimg.Sampling(cfg_scale=4.0)
    labels = list(range(args.images))
    print(f"\n== {preset}: {args.tokens} tokens/image, CFG 4, {dtype}, {device}")

    ar = specimg.Engine(target, method="ar", sampling=sampling)
    ar.generate([0], seed=99)
    out, wall = timed(device, lambda: ar.generate(labels, seed=0))
    ar_rate = out.stats.tokens / wall
    print(f"AR: {ar_rate:.1f} tokens/s ({1000 / ar_rate:.2f} ms/token)")

    cost = costs.measure(target, drafter, sampling, 0, "gpu-bench", preset)
    print("verify ms by nodes: " + "  ".join(f"{n}: {ms:.2f}" for n, ms in cost.verify_ms))
    print("draft level ms by top-k: " + "  ".join(f"{k}: {ms:.2f}" for k, ms in cost.draft_level_ms))
    print(f"AR step {cost.ar_ms:.2f} ms, drafter start {cost.draft_start_ms:.2f} ms, step overhead {cost.overhead_ms:.2f} ms")
    plan = planner.choose(cost, TYPICAL, target.max_tree_nodes, max_fed=drafter.max_tree_nodes)
    print(f"auto tree for a typical profile: {plan}, {plan.tokens_per_step:.2f} tokens/step, predicted {plan.speedup:.2f}x")

    greedy = specimg.Sampling(cfg_scale=4.0, temperature=0.0)
    ar_greedy = specimg.Engine(target, method="ar", sampling=greedy)
    reference, ar_wall = timed(device, lambda: ar_greedy.generate(labels, seed=0))
    spec_wall, tau, predicted = 0.0, [], []
    for i, label in enumerate(labels):
        oracle = GreedyOracle(target.vocab_size, reference.tokens[i].to(device))
        engine = specimg.Engine(target, oracle, "naive", sampling=greedy, cost_model=cost)
        result, wall = timed(device, lambda: engine.generate([label], seed=i))
        assert torch.equal(result.tokens[0], reference.tokens[i].cpu()), "the oracle's tokens must be AR's"
        spec_wall += wall
        tau.append(result.stats.tau)
        predicted.append(result.stats.predicted_speedup or 0.0)
    print(
        f"naive + greedy oracle on auto trees: tau {np.mean(tau):.2f}, speedup {ar_wall / spec_wall:.2f}x "
        f"(cost model predicted {np.mean(predicted):.2f}x): the engine's ceiling here"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--presets", default="GPT-B,GPT-XL")
    parser.add_argument("--tokens", type=int, default=256, help="image tokens (a square)")
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"specimg GPU benchmark on {name}, torch {torch.__version__}")
    for preset in args.presets.split(","):
        bench_preset(preset.strip(), args, device, dtype)


if __name__ == "__main__":
    main()
