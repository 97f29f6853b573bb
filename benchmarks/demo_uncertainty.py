"""How uncertain the demo target is where it samples, at one or more sampling settings.

For each setting it draws ``--per-class`` images per class with the target's batched AR
sampler (the engine's draws), then reads the processed next-token distribution at every
position (``specimg.eval.uncertainty``): top-1 probability, entropy, codes carrying 90 % of
the mass.  Prints one row per setting and, with matplotlib, writes the histograms of top-1
and entropy to ``--plot``.

    python benchmarks/demo_uncertainty.py [--bundle DIR] [--per-class 10] \
        [--temperature 1.0 --temperature 0.6] [--plot docs/demo-uncertainty.png]

Temperatures not given: the demo's default sampling only.  Other temperatures keep the
default's CFG and top-k.
"""

from __future__ import annotations

import argparse
import math

import attrs
import torch

from specimg.demo.data import NUM_CLASSES
from specimg.engine import ar_tokens
from specimg.eval.uncertainty import ENTROPY_BINS, TOP1_BINS, Uncertainty, sampled_uncertainty
from specimg.files import atomic_path
from specimg.models.demo import demo_sampling, load_demo


def describe(sampling) -> str:
    top_k = f", top-k {sampling.top_k}" if sampling.top_k else ""
    return f"CFG {sampling.cfg_scale:g}, temperature {sampling.temperature:g}{top_k}"


def plot(results: list[tuple[str, Uncertainty]], path: str) -> bool:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(10, 3.8), dpi=100, layout="constrained")
    top1_ax, entropy_ax = fig.subplots(1, 2)
    log_v = math.log(results[0][1].vocab_size)
    for label, u in results:
        weights = torch.full_like(u.top1, 1 / u.top1.numel()).numpy()
        top1_ax.hist(u.top1.numpy(), bins=TOP1_BINS, range=(0, 1), weights=weights, histtype="step", linewidth=1.5, label=label)
        entropy_ax.hist(u.entropy.numpy(), bins=ENTROPY_BINS, range=(0, log_v), weights=weights, histtype="step", linewidth=1.5, label=label)
    top1_ax.axvline(0.1, linestyle="--", color="0.55", linewidth=1)
    top1_ax.set_xlabel("top-1 probability at a sampled position")
    top1_ax.set_ylabel("share of positions")
    entropy_ax.set_xlabel(f"entropy (nats; ln V = {log_v:.2f})")
    for ax in (top1_ax, entropy_ax):
        ax.grid(True, color="0.92")
        ax.legend(fontsize=8)
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=None, help="a demo bundle folder (default: the shipped one)")
    parser.add_argument("--per-class", type=int, default=10)
    parser.add_argument("--temperature", type=float, action="append", help="repeatable; default: the demo's default only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", default=None, help="write the histograms to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    models = load_demo(args.bundle)
    default = demo_sampling(args.bundle)
    settings = [default] if not args.temperature else [attrs.evolve(default, temperature=t) for t in args.temperature]
    classes = torch.arange(NUM_CLASSES).repeat_interleave(args.per_class)
    seeds = [30_000 + i for i in range(classes.numel())]
    print(f"{classes.numel()} images per setting, V = {models.target.vocab_size}")
    print("| sampling | top-1 p10 / median / p90 | top-1 <= 0.1 | top-1 < 0.05 | entropy median | codes for 90 % |")
    print("|---|---|---:|---:|---:|---:|")
    results = []
    for sampling in settings:
        with torch.no_grad():
            tokens = ar_tokens(models.target, classes.tolist(), seeds, sampling)
        u = sampled_uncertainty(models.target, classes, tokens, sampling)
        s = u.summary()
        q = " / ".join(f"{x:.2f}" for x in s["top1_p10_median_p90"])
        print(f"| {describe(sampling)} | {q} | {s['share_top1_at_most_0.1']:.1%} | {s['share_top1_below_0.05']:.1%} "
              f"| {s['entropy_median_nats']:.2f} | {s['codes_for_90pct_median']} |")
        results.append((describe(sampling), u))
    if args.plot:
        print(f"-> {args.plot}" if plot(results, args.plot) else "no plot: it needs matplotlib (pip install 'specimg[plot]')")


if __name__ == "__main__":
    main()
