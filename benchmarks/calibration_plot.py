"""The speed-quality frontier of relaxation sweeps, from `specimg bench` runs.

Reads one or more ``bench.json`` files (each a sweep on the same fixed tree, with its own
`naive` or AR baseline) and draws, per relaxed variant, tau over naive's tau against the
budget it actually spent (TVD per emitted token), and its Fréchet distance to the run's AR
samples against the same, with the AR-vs-AR floor of each run as a dashed line.  Prints
the points it drew.

    python benchmarks/calibration_plot.py sweep-a/bench.json sweep-b/bench.json \
        --plot docs/calibration-near-duplicate.png
"""

from __future__ import annotations

import argparse
import json

from specimg.files import atomic_path


def points(paths: list[str]) -> tuple[list[dict], list[float]]:
    """Every relaxed variant of the runs with tau relative to naive's at the same number of
    images (from its own run or another of the given runs, all on one tree and seeds: naive
    is exact and seeded, so its tau is the same), and the runs' AR-vs-AR Fréchet floors."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append((path, json.load(f)))
    naive = {v["images"]: v["tau"] for _, run in runs for v in run["variants"] if v["label"] == "naive"}
    found, floors = [], []
    for path, run in runs:
        floors.append(run.get("floors", {}).get("frechet_ar", {}).get("value", float("nan")))
        for v in run["variants"]:
            if v["label"] in ("ar", "naive") or not v.get("tvd"):
                continue
            if v["images"] not in naive:
                raise ValueError(f"{path}: no naive run of {v['images']} images among the given runs")
            found.append({"label": f"{v['label']} (n={v['images']})", "stack": v["method"], "tvd": v["tvd"], "gain": v["tau"] / naive[v["images"]],
                          "fd_ar": v["quality"]["frechet_ar"]["value"], "n": v["images"]})
    return found, floors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="bench.json files")
    parser.add_argument("--plot", help="PNG to write (needs matplotlib)")
    args = parser.parse_args()
    try:
        found, floors = points(args.runs)
    except (OSError, ValueError, KeyError) as err:
        parser.error(str(err))
    print("| variant | n | tvd | tau / naive | FD vs AR |\n|---|---:|---:|---:|---:|")
    for p in sorted(found, key=lambda p: p["tvd"]):
        print(f"| {p['label']} | {p['n']} | {p['tvd']:.3f} | {p['gain']:.2f} | {p['fd_ar']:.2f} |")
    if args.plot:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
        gain_ax, fd_ax = fig.subplots(1, 2)
        colours = {stack: f"C{i}" for i, stack in enumerate(sorted({p["stack"] for p in found}))}
        markers = {n: "o*sD"[i % 4] for i, n in enumerate(sorted({p["n"] for p in found}))}
        for p in found:  # colour: the stack; marker: the number of images
            for ax, y in ((gain_ax, p["gain"]), (fd_ax, p["fd_ar"])):
                ax.scatter(p["tvd"], y, s=28, color=colours[p["stack"]], marker=markers[p["n"]])
        for stack, colour in colours.items():
            gain_ax.scatter([], [], color=colour, label=stack)
        for n, marker in markers.items():
            gain_ax.scatter([], [], color="0.4", marker=marker, label=f"n = {n}")
        gain_ax.legend(fontsize=8)
        for floor in sorted(set(floors)):
            fd_ax.axhline(floor, linestyle="--", color="0.55", linewidth=1)
        gain_ax.set_ylabel("tau / naive's tau")
        fd_ax.set_ylabel("Fréchet distance to AR (dashed: AR vs AR)")
        for ax in (gain_ax, fd_ax):
            ax.set_xlabel("TVD spent per emitted token")
            ax.grid(True, color="0.92")
        with atomic_path(args.plot, ".png") as tmp:
            fig.savefig(tmp, format="png")
        print(f"-> {args.plot}")


if __name__ == "__main__":
    main()
