"""The engine on a GPU: AR speed eager and compiled, the verify cost curve, the default bench
on the demo, and the engine's ceiling, for the demo and LlamaGen-shaped random-weight targets.

Per model (the demo; GPT-B and GPT-XL shapes, 256 image tokens, CFG 4, bf16 unless said):

- AR ms/token, one image at a time as the engine decodes, with eager step forwards and
  compiled ones (``--compile off`` / ``on``: torch.compile, captured as CUDA graphs), and
  the compile time;
- batched decoding (``--batch-sizes``, default 1,4,16) for AR, naive and cascade+lantern
  (cascade at GPT shapes, which have no tokenizer): images/s per batch size, and how many
  tokens of the first ``--images`` images differ from one-at-a-time decoding (rounding);
- the cost model in both step modes: verify time of trees of 1..128 nodes, the drafter's
  start and levels, the AR step;
- (demo) the default ``specimg bench`` (every method, quality on) and its wall time;
- naive with an oracle drafter that drafts AR's own greedy tokens, on auto trees, in
  float32 (so the tree forward and the one-token forward agree to the last bit but for
  rare ties, which are counted, not fatal): its speedup over compiled AR is the most this
  engine gives here, and its ratio to the cost model's prediction is the engine's own
  overhead.

    python benchmarks/gpu.py --quick --out gpu.json    # one H200: a few minutes
    python benchmarks/gpu.py --first-run --out gpu.json   # the first run's table: under 8 minutes on one H100
    python benchmarks/gpu.py --device cpu --dtype float32 --presets GPT-B --tokens 16 --images 1 --no-bench   # a smoke run

Random weights: the timings are those of real checkpoints of the same shape; the
acceptance is not (see the oracle).  Every section's numbers go to one JSON (``--out``),
rewritten after each section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import specimg
from specimg import costs, planner
from specimg.compiled import CompileClock
from specimg.models.base import cfg_rows
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.profile import MAX_DEPTH, MAX_TOPK

TYPICAL = np.array([[0.6 * 0.45**r for r in range(MAX_TOPK)]] * MAX_DEPTH)
"""A typical acceptance profile: rank-r child accepted with 0.6 * 0.45**r at every depth."""


class GreedyOracle:
    """A drafter that knows the target's greedy tokens for the image being decoded: its
    logits put all mass on the token AR picked at each position."""

    def __init__(self, vocab_size: int, tokens: torch.Tensor):
        self.vocab_size, self.tokens = vocab_size, tokens
        self.max_tree_nodes = 128

    def prefill(self, condition: Any, cfg: bool) -> None:
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


class Report:
    """The run's tables, written to ``path`` after every section."""

    def __init__(self, path: str | None, header: dict[str, Any]):
        self.path, self.data = path, {**header, "sections": {}}

    def add(self, section: str, values: dict[str, Any]) -> None:
        self.data["sections"][section] = values
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(self.path + ".tmp", self.path)


def timed(device: torch.device, run: Callable[[], Any]) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def step_modes(device: torch.device) -> list[str]:
    return ["off", "on"] if device.type == "cuda" else ["off"]


def ar_speed(target: Any, sampling: specimg.Sampling, conditions: list[Any], device: torch.device) -> dict[str, Any]:
    """AR ms/token per step mode (a warm-up image first: it compiles the programs)."""
    out: dict[str, Any] = {}
    compiling = CompileClock.seconds
    for mode in step_modes(device):
        engine = specimg.Engine(target, method="ar", sampling=sampling, compile=mode)
        _, warm = timed(device, lambda: engine.generate(conditions[:1], seed=99))
        result, wall = timed(device, lambda: engine.generate(conditions, seed=0))
        out[mode] = {"ms_per_token": 1000 * wall / result.stats.tokens, "warmup_image_s": warm}
    out["compile_s"] = CompileClock.seconds - compiling
    return out


def batches(models: tuple[Any, Any, Any], sampling: specimg.Sampling, methods: list[str], sizes: list[int], images: int,
            device: torch.device) -> dict[str, Any]:
    """Batched decoding per method (``models``: target, drafter, tokenizer): images/s per
    batch size (max(B, ``images``) images, after a warm-up batch; auto trees planned with
    the cost model measured at that size) and the tokens of the first ``images`` images
    that differ from one-at-a-time decoding under the same cost model (rounding)."""
    target, drafter, tokenizer = models
    labels = [i % 10 for i in range(max(max(sizes), images))]
    out: dict[str, Any] = {}
    for method in methods:
        out[method] = {}
        for size in sizes:
            engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=sampling, tokenizer=tokenizer, batch_size=size)
            engine.generate(labels[:size], seed=99)  # warm, and measures the cost model at this size
            count = max(size, images)
            result, wall = timed(device, lambda: engine.generate(labels[:count], seed=0))
            alone = specimg.Engine(target, engine.drafter, method, sampling=sampling, tokenizer=tokenizer, cost_model=engine.cost_model)
            reference = torch.cat([alone.generate([label], seed=i).tokens for i, label in enumerate(labels[:images])])
            row = {"images_per_s": count / wall, "tau": result.stats.tau, "tokens_differing": int((result.tokens[:images] != reference).sum())}
            out[method][size] = row
            print(f"  {method} at batch size {size}: {row['images_per_s']:.2f} images/s, tau {row['tau']:.2f}, "
                  f"{row['tokens_differing']} of {reference.numel()} tokens differ from one at a time")
    return out


def cost_curves(target: Any, drafter: Any, sampling: specimg.Sampling, condition: Any, device: torch.device) -> dict[str, Any]:
    out = {}
    for mode in step_modes(device):
        specimg.Engine(target, method="ar", sampling=sampling, compile=mode)  # sets the step mode
        cost = costs.measure(target, drafter, sampling, condition)
        plan = planner.choose(cost, TYPICAL, target.max_tree_nodes, max_fed=drafter.max_tree_nodes)
        out[mode] = {
            "ar_ms": cost.ar_ms, "verify_ms": dict(cost.verify_ms), "draft_start_ms": cost.draft_start_ms,
            "draft_level_ms": dict(cost.draft_level_ms), "overhead_ms": cost.overhead_ms,
            "typical_plan": str(plan), "typical_predicted_speedup": plan.speedup,
        }
        print(f"  compile {mode}: AR step {cost.ar_ms:.2f} ms, verify " + "  ".join(f"{n}: {ms:.2f}" for n, ms in cost.verify_ms))
        print(f"    drafter start {cost.draft_start_ms:.2f} ms, level by top-k " + "  ".join(f"{k}: {ms:.2f}" for k, ms in cost.draft_level_ms)
              + f", overhead {cost.overhead_ms:.2f} ms; typical profile: {plan} predicted {plan.speedup:.2f}x")
    return out


def oracle(target: Any, conditions: list[Any], device: torch.device) -> dict[str, Any]:
    """naive with the greedy oracle over AR, float32, the engine's default step mode."""
    greedy = specimg.Sampling(cfg_scale=4.0, temperature=0.0)
    ar = specimg.Engine(target, method="ar", sampling=greedy)
    ar.generate(conditions[:1], seed=99)
    reference, ar_wall = timed(device, lambda: ar.generate(conditions, seed=0))
    cost = costs.measure(target, GreedyOracle(target.vocab_size, reference.tokens[0].to(device)), greedy, conditions[0])
    spec_wall, tau, predicted, differ = 0.0, [], [], 0
    for i, condition in enumerate(conditions):
        drafter = GreedyOracle(target.vocab_size, reference.tokens[i].to(device))
        engine = specimg.Engine(target, drafter, "naive", sampling=greedy, cost_model=cost)
        result, wall = timed(device, lambda: engine.generate([condition], seed=i))
        differ += int((result.tokens[0] != reference.tokens[i].cpu()).sum())
        spec_wall += wall
        tau.append(result.stats.tau)
        predicted.append(result.stats.predicted_speedup or 0.0)
    speedup = ar_wall / spec_wall
    out = {"tau": float(np.mean(tau)), "speedup": speedup, "predicted": float(np.mean(predicted)),
           "speedup_over_predicted": speedup / max(1e-9, float(np.mean(predicted))), "tokens_differing_from_ar": differ,
           "ar_ms_per_token": 1000 * ar_wall / reference.stats.tokens}
    print(f"  oracle naive (float32): tau {out['tau']:.2f}, {speedup:.2f}x over AR (predicted {out['predicted']:.2f}x), "
          f"{differ} tokens differ from AR (rounding ties)")
    return out


def bench_preset(preset: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, report: Report) -> None:
    print(f"\n== {preset}: {args.tokens} tokens/image, CFG 4, {dtype}, {device}")
    with torch.device(device):  # built in place: no host copy of a large model
        target = build_target(preset, block_size=args.tokens, seed=0).to(dtype=dtype)
    drafter = build_drafter(target, seed=1)
    sampling = specimg.Sampling(cfg_scale=4.0)
    labels = list(range(args.images))
    speed = ar_speed(target, sampling, labels, device)
    print("  AR ms/token: " + ", ".join(f"compile {g} {speed[g]['ms_per_token']:.2f}" for g in step_modes(device))
          + f" (compile {speed['compile_s']:.2f} s)")
    result: dict[str, Any] = {"ar": speed, "costs": cost_curves(target, drafter, sampling, 0, device)}
    if not args.first_run:
        result["batches"] = batches((target, drafter, None), sampling, ["ar", "naive", "cascade"], args.batch_sizes, args.images, device)
    del drafter
    if not args.first_run or preset == "GPT-XL":
        target = target.float()
        result["oracle_float32"] = oracle(target, labels, device)
    report.add(preset, result)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()


def demo_speed(args: argparse.Namespace, device: torch.device, report: Report) -> bool:
    """The demo's AR speed and cost curves; False when this checkout has no bundle."""
    from specimg.models.demo import bundle_exists, demo_sampling, load_demo

    if not bundle_exists():
        print("\n== demo: no bundle in this checkout, skipped")
        return False
    print(f"\n== demo (float32, {device})")
    models = load_demo()
    target, drafter = models.target.to(device), models.drafter.to(device)
    sampling = demo_sampling()
    labels = list(range(min(args.images, 10)))
    speed = ar_speed(target, sampling, labels, device)
    print("  AR ms/token: " + ", ".join(f"compile {g} {speed[g]['ms_per_token']:.2f}" for g in step_modes(device))
          + f" (compile {speed['compile_s']:.2f} s)")
    result = {"ar": speed, "costs": cost_curves(target, drafter, sampling, 0, device)}
    if not args.first_run:
        result["batches"] = batches((target, drafter, models.tokenizer), sampling, ["ar", "naive", "cascade+lantern"], args.batch_sizes, args.images, device)
    result["fixed_tree"] = tree_runs(target, drafter, models.tokenizer, sampling, device, specimg.TreeConfig(kind="dynamic", depth=4, topk=4, total_tokens=24))
    result["auto_tree"] = tree_runs(target, drafter, models.tokenizer, sampling, device, specimg.TreeConfig())
    report.add("demo", result)
    return True


def tree_runs(target: Any, drafter: Any, tokenizer: Any, sampling: specimg.Sampling, device: torch.device, tree: specimg.TreeConfig) -> dict[str, Any]:
    """AR, naive, cascade and cascade+lantern on ``tree`` (a fixed EAGLE-2 tree: no planner,
    so no AR fallback; or auto trees): ms/token, tau, and on CUDA the host-device
    synchronisations of one image."""
    out = {}
    for method in ("ar", "naive", "cascade", "cascade+lantern"):
        engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=sampling, tree=tree, tokenizer=tokenizer)
        engine.generate([0], seed=1)  # warm: compiles, and on auto trees calibrates
        result, wall = timed(device, lambda: engine.generate([1, 2], seed=0))
        row = {"ms_per_token": 1000 * wall / result.stats.tokens, "tau": result.stats.tau}
        if device.type == "cuda":
            from specimg.testing.syncs import count_syncs

            steps = []
            syncs = count_syncs(lambda: steps.append(engine.generate([0], seed=0).stats.images[0]))
            row["syncs_per_image"] = syncs
            row["steps_per_image"] = len(steps[0].accepted) or target.num_tokens - 1
        out[method] = row
        print(f"  {method} on {tree.kind} trees: {row['ms_per_token']:.2f} ms/token, tau {row['tau']:.2f}"
              + (f", {row['syncs_per_image']} syncs in {row['steps_per_image']} steps" if "syncs_per_image" in row else ""))
    return out


def demo_bench(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """The default ``specimg bench`` on the demo (every method, quality on), timed whole."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "specimg.cli", "bench", "-n", str(args.bench_images), "--device", str(device), "--out", out]
        print(f"\n== demo: specimg bench -n {args.bench_images} --device {device}")
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.bench_timeout)
        except subprocess.TimeoutExpired:
            print(f"  did not finish in {args.bench_timeout} s")
            report.add("demo_bench", {"command": " ".join(command[2:]), "wall_s": None, "timeout_s": args.bench_timeout})
            return
        wall = time.perf_counter() - start
        print(done.stdout[-4000:] if done.returncode == 0 else done.stderr[-4000:])
        bench: dict[str, Any] = {"command": " ".join(command[2:]), "wall_s": wall, "returncode": done.returncode}
        if done.returncode == 0:
            with open(os.path.join(out, "bench.json")) as f:
                doc = json.load(f)
            bench.update(variants=doc["variants"], step=doc.get("step"), runtime_s=doc.get("runtime_s"))
        print(f"  {wall:.0f} s")
        report.add("demo_bench", bench)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--presets", default="GPT-B,GPT-XL")
    parser.add_argument("--tokens", type=int, default=256, help="image tokens (a square)")
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,4,16", type=lambda t: [int(x) for x in t.split(",")], help="batch sizes of the batched-decoding table")
    parser.add_argument("--quick", action="store_true", help="one image per measurement (a short device lease)")
    parser.add_argument("--first-run", action="store_true",
                        help="--quick without the batch tables and the bench, the oracle at GPT-XL alone: a first device run's table")
    parser.add_argument("--bench-images", type=int, default=16, help="images per method in the demo's default bench")
    parser.add_argument("--bench-timeout", type=int, default=150, help="seconds the demo's bench may take")
    parser.add_argument("--no-bench", dest="bench", action="store_false", help="skip the demo's default bench")
    parser.add_argument("--no-demo", dest="demo", action="store_false", help="skip the demo")
    parser.add_argument("--out", default=None, help="JSON file for every table")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs)")
    args = parser.parse_args()
    if args.quick or args.first_run:
        args.images = 1
    if args.first_run:
        args.bench = False
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"specimg GPU benchmark on {name}, torch {torch.__version__}")
    report = Report(args.out, {"device": name, "torch": torch.__version__, "dtype": args.dtype, "tokens": args.tokens})
    demo = args.demo and demo_speed(args, device, report)
    for preset in filter(None, args.presets.split(",")):
        bench_preset(preset.strip(), args, device, dtype, report)
    if demo and args.bench:
        demo_bench(args, device, report)


if __name__ == "__main__":
    main()
