"""``specimg bench``: methods side by side on one target/drafter pair, the same conditions
and the same per-sample seeds, interleaved (so slow phases of a shared machine hit every
method alike), resumable from the run log (:mod:`specimg.runs.log`, the one ``generate``
keeps) and dealt over processes; what it does and what its numbers mean: docs/usage.md,
"Benchmarking".

:func:`run_bench` produces the records; :func:`summarise` turns them into one row per
variant; :func:`write_outputs` writes ``bench.json``, ``bench.csv``, ``bench.md`` and ``bench.png``.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from specimg import costs
from specimg.config import Sampling, TreeConfig
from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.compiled import Compile
from specimg.methods import AR, split_stack
from specimg.models.base import Caption, Condition
from specimg.progress import progress_bar
from specimg.runs.log import RunLog, open_run
from specimg.stats import PHASES, ImageStats, RunStats

DEFAULT_METHODS = ("ar", "naive", "lantern", "lantern++", "gsd", "cascade", "cascade+lantern", "coolsd")
DEFAULT_IMAGES = 16
"""Images per method of a default ``specimg bench``: few, so that the default run stays short on a CPU."""
FORMAT = "specimg-bench/1"
MISSING_PLOT = "no bench.png: the plot needs matplotlib (pip install 'specimg[plot]')"


# ----------------------------------------------------------------------------- variants


@attrs.frozen
class Variant:
    """One column of the benchmark: a method stack with its options (and stack budget),
    decoding ``batch_size`` images at a time."""

    label: str
    method: str
    options: dict[str, dict[str, str]] = attrs.field(factory=dict)
    delta: float | None = None
    sweep: tuple[tuple[str, str], ...] = ()
    batch_size: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "sweep": dict(self.sweep)}


def stack_members(method: str, installed: Iterable[str]) -> list[str]:
    """The members of one ``--methods`` entry (split as every method string is), each
    installed or ``ar``, which stands alone."""
    if not method.strip():
        raise SpecimgError("an empty method in --methods")
    known = set(installed) | {AR}
    members = split_stack(method)
    unknown = next((m for m in members if m not in known), None)
    if unknown is not None:
        raise SpecimgError(f"unknown method {unknown!r} in {method!r} (installed: {', '.join(sorted(known))})")
    if AR in members and len(members) > 1:
        raise SpecimgError(f"'ar' cannot be stacked ({method!r})")
    return members


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``"cascade.delta=0.1,0.3"`` -> ``("cascade.delta", ["0.1", "0.3"])``; ``"delta=..."``
    sweeps the stack budget."""
    key, sep, values = text.partition("=")
    key = key.strip()
    items = [v.strip() for v in values.split(",")]
    if not sep or not key or not all(items) or (key != "delta" and "." not in key.strip(".")):
        raise SpecimgError(f"--sweep takes METHOD.KEY=V1,V2,... or delta=V1,V2,..., not {text!r}")
    if len(set(items)) != len(items):
        raise SpecimgError(f"--sweep {key} names a value twice")
    return key, items


def plan_variants(
    methods: Sequence[str] | None,
    installed: Iterable[str],
    options: Mapping[str, Mapping[str, str]] | None = None,
    sweeps: Sequence[str] = (),
    delta: float | None = None,
    batch_sizes: Sequence[int] = (1,),
) -> tuple[list[Variant], list[str]]:
    """The variants to run, AR first at each batch size, and notes for the user (methods
    skipped, AR added).  With more than one batch size, labels end in `` B=<size>``.

    ``methods`` None: DEFAULT_METHODS, keeping the stacks whose members are installed."""
    if not batch_sizes or len(set(batch_sizes)) != len(batch_sizes) or min(batch_sizes) < 1:  # a size twice would run a variant twice
        raise SpecimgError(f"--batch-size takes distinct sizes of 1 or more, not {','.join(map(str, batch_sizes))!r}")
    installed = set(installed)
    notes: list[str] = []
    if methods is None:
        stacks = []
        for stack in DEFAULT_METHODS:
            try:
                stacks.append((stack, stack_members(stack, installed)))
            except SpecimgError:
                notes.append(f"skipped {stack} (not installed)")
    else:
        stacks = [(m.strip(), stack_members(m, installed)) for m in methods]
    names = [stack for stack, _ in stacks]
    twice = next((stack for i, stack in enumerate(names) if stack in names[:i]), None)
    if twice is not None:
        raise SpecimgError(f"--methods names {twice!r} twice")
    if AR not in names:
        stacks.insert(0, (AR, [AR]))
        notes.append("added ar: it is the speedup baseline")
    options = options or {}
    parsed = [parse_sweep(s) for s in sweeps]
    if len({k for k, _ in parsed}) != len(parsed):
        raise SpecimgError("two --sweep options for one key")
    members_anywhere = {m for _, members in stacks for m in members}
    for name in options:
        if name not in members_anywhere:
            raise SpecimgError(f"options given for {name!r}, which is in no benchmarked stack")
    for key, _ in parsed:
        owner = key.rpartition(".")[0]
        if key != "delta" and owner not in members_anywhere:
            raise SpecimgError(f"--sweep {key}: {owner!r} is in no benchmarked stack")
    variants: list[Variant] = []
    for (stack, members), batch in itertools.product(stacks, batch_sizes):
        mine = [(k, vals) for k, vals in parsed if (k == "delta" and AR not in members) or k.rpartition(".")[0] in members]
        for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in mine]):
            opts = {m: dict(options[m]) for m in members if m in options}
            stack_delta = None if stack == AR else delta
            for key, val in combo:
                if key == "delta":
                    try:
                        stack_delta = float(val)
                    except ValueError:
                        raise SpecimgError(f"--sweep delta={val!r} is not a number") from None
                else:
                    owner, _, opt = key.rpartition(".")
                    opts.setdefault(owner, {})[opt] = val
            shown = [(k.rpartition(".")[2] if len(members) == 1 and k != "delta" else k, v) for k, v in combo]
            label = " ".join([stack] + [f"{k}={v}" for k, v in shown] + ([f"B={batch}"] if len(batch_sizes) > 1 else []))
            variants.append(Variant(label, stack, opts, stack_delta, tuple(combo), batch))
    variants.sort(key=lambda v: v.method != AR)  # the baselines first
    return variants, notes


# ----------------------------------------------------------------------------- running


@attrs.frozen(eq=False)
class BenchSpec:
    """What to run: variants, conditions (class ids or captions, with a JSON-able key for
    each: the label or the caption text), the base seed, sampling and tree settings."""

    variants: tuple[Variant, ...]
    conditions: tuple[Condition, ...]
    condition_keys: tuple[Any, ...]
    seed: int = 0
    sampling: Sampling = Sampling()
    tree: TreeConfig = TreeConfig()
    warmup: int = 1
    inputs: Mapping[str, Any] = attrs.field(factory=dict)
    """The model files' fingerprint (:func:`specimg.runs.folder.inputs_fingerprint`), if known."""

    def settings(self, model: str) -> dict[str, Any]:
        """What a resumed run must share with the one that wrote the manifest (the sample
        count is not part of it: more images extend a run)."""
        return {
            "format": FORMAT, "model": model, "variants": [v.as_dict() for v in self.variants],
            "sampling": attrs.asdict(self.sampling), "tree": attrs.asdict(self.tree), "seed": self.seed,
            "condition_kind": "caption" if any(isinstance(c, Caption) for c in self.conditions) else "class",
            **({"inputs": dict(self.inputs)} if self.inputs else {}),
        }


@attrs.frozen(eq=False)
class BenchRun:
    """The gathered records (sorted by sample, then variant) and how many of them this
    process computed in this call (the rest came from the manifest)."""

    records: list[dict[str, Any]]
    computed: int
    engines: dict[str, Engine] = attrs.field(factory=dict, repr=False)


def build_engines(models: Any, spec: BenchSpec, plugins: Any = None, compile: Compile = "auto") -> dict[str, Engine]:
    """One engine per variant (bad options fail here, before anything runs), its batch no
    larger than the images: it plans, calibrates and warms up at the size it decodes."""
    engines = {}
    for v in spec.variants:
        drafter = None if v.method == AR else models.drafter
        engines[v.label] = Engine(
            models.target, drafter, v.method, v.options or None, spec.sampling, spec.tree,
            delta=v.delta, tokenizer=models.tokenizer, plugins=plugins, compile=compile,
            batch_size=min(v.batch_size, len(spec.conditions)),
        )
    return engines


def run_bench(
    models: Any,
    spec: BenchSpec,
    out: str | os.PathLike[str],
    *,
    state: Any,
    engines: Mapping[str, Engine] | None = None,
    progress: bool = True,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> BenchRun:
    """Generate every (sample, variant) not yet in ``out``'s run log; return all records.

    ``state``: an ``accelerate.PartialState``.  Sample i goes to process ``i % num_processes``.  ``on_record`` is called
    after each record is safely written (tests use it to stop a run); ``progress`` False
    hides the progress bars.
    """
    engines = dict(engines) if engines is not None else build_engines(models, spec)
    nv = len(spec.variants)
    expected = [{"condition": spec.condition_keys[i], "label": v.label} for i in range(len(spec.conditions)) for v in spec.variants]
    # what changes the images besides the spec: device, dtype, and for auto trees the cost model that shapes them
    weights = models.target.input_embeddings()
    settings = {**spec.settings(models.name), "device": weights.device.type, "dtype": str(weights.dtype)}
    auto = next((e for e in engines.values() if e.auto_tree), None)
    if auto is not None:
        settings["cost_model"] = costs.cost_key(auto.target, auto.drafter, auto.sampling)[0]
    with open_run(out, settings, state) as log:
        mismatch = log.first_mismatch(expected)
        if mismatch is not None:  # every process checks every sample, so that all of them stop alike
            index, _, _, _ = mismatch
            held = log.done[index]
            raise SpecimgError(
                f"{log.out} holds sample {index // nv} for condition {held.get('condition')!r} ({held.get('label')}), this run asks for "
                f"{spec.condition_keys[index // nv]!r} ({spec.variants[index % nv].label}); use another --out or remove it"
            )
        mine = list(range(state.process_index, len(spec.conditions), state.num_processes))
        todo = _work(spec, mine, log)
        for engine in engines.values():  # every process plans auto trees on the main process's cost model
            engine.prepare(spec.conditions[0], state)
        show = progress if state.is_main_process else False
        if todo and spec.warmup > 0:  # spec.warmup discarded images per engine, on seeds no sample uses
            total = sum(e.batch_size for e in engines.values()) * spec.warmup * int(models.target.num_tokens)
            with progress_bar(total=total, desc="warm-up", unit="tok", show=show) as bar:
                for engine in engines.values():
                    for k in range(spec.warmup):
                        engine.generate([spec.conditions[0]] * engine.batch_size, seeds=[spec.seed - 1 - k] * engine.batch_size, progress=bar.update)
        computed = _generate(engines, spec, todo, log, int(models.target.num_tokens), show, on_record)
        local = [{k: x for k, x in log.done[i * nv + v].items() if k not in ("settings", "index")} for i in mine for v in range(nv)]
        if state.num_processes > 1:
            from accelerate.utils import gather_object

            state.wait_for_everyone()
            local = gather_object(local)
    return BenchRun(sorted(local, key=lambda r: (r["sample"], r["variant"])), computed, engines)


def _work(spec: BenchSpec, mine: Sequence[int], log: RunLog) -> list[tuple[list[int], int]]:
    """What is left to generate, in order: (samples, variant) batches.  ``mine`` is cut
    into blocks of the largest batch size; each block is made by every variant, in an
    order rotating with the block, each variant in batches of its size."""
    nv, size = len(spec.variants), max(v.batch_size for v in spec.variants)
    work = []
    for b, at in enumerate(range(0, len(mine), size)):
        block = mine[at : at + size]
        for v in ((k + b) % nv for k in range(nv)):
            left = [i for i in block if i * nv + v not in log.done]
            batch = spec.variants[v].batch_size
            work += [(left[k : k + batch], v) for k in range(0, len(left), batch)]
    return work


def _generate(
    engines: Mapping[str, Engine],
    spec: BenchSpec,
    todo: Sequence[tuple[list[int], int]],
    log: RunLog,
    per_image: int,
    show: bool,
    on_record: Callable[[dict[str, Any]], None] | None,
) -> int:
    """Generate each (samples, variant) batch of ``todo``, adding a record per image to
    the run log; returns how many images."""
    nv, images = len(spec.variants), sum(len(samples) for samples, _ in todo)
    with progress_bar(total=images * per_image, desc=f"bench ({images} images)", unit="tok", show=show) as bar:
        for samples, v in todo:
            variant = spec.variants[v]
            bar.set_postfix_str(f"image {samples[0]} {variant.label}", refresh=False)
            seeds = [spec.seed + i for i in samples]
            result = engines[variant.label].generate([spec.conditions[i] for i in samples], seeds=seeds, progress=bar.update)
            for row, (i, stats) in enumerate(zip(samples, result.stats.images)):
                record = {
                    "sample": i, "variant": v, "label": variant.label, "condition": spec.condition_keys[i], "seed": spec.seed + i,
                    "tokens": result.tokens[row].tolist(), "stats": stats.as_dict(),
                }
                log.add(i * nv + v, record)
                if on_record is not None:
                    on_record(record)
    return images


# ----------------------------------------------------------------------------- summary


def summarise(
    records: Sequence[Mapping[str, Any]], spec: BenchSpec, quality: Any = None, engines: Mapping[str, Engine] | None = None
) -> dict[str, Any]:
    """One row per variant: its speed (speedup against AR at the variant's batch size, on the
    same samples), draft and budget figures, seconds per phase per image, and the quality
    metrics (``quality``: a :class:`specimg.eval.quality.Quality`); what each means:
    docs/usage.md, "What the numbers mean".  With ``engines``, each row also records the
    options and budget actually used."""
    by_label: dict[str, list[Mapping[str, Any]]] = {v.label: [] for v in spec.variants}
    for r in records:
        by_label[r["label"]].append(r)
    counts = {len(rs) for rs in by_label.values()}
    if len(counts) != 1:
        raise SpecimgError(f"the records are incomplete: samples per method {sorted(counts)}")
    n = counts.pop()
    baselines = {v.batch_size: v.label for v in reversed(spec.variants) if v.method == AR}
    baseline = next(v.label for v in spec.variants if v.method == AR)
    stats = {label: RunStats(tuple(ImageStats.from_dict(r["stats"]) for r in rs)) for label, rs in by_label.items()}
    rows = []
    for v in spec.variants:
        run = stats[v.label]
        seconds = run.seconds()
        engine = engines.get(v.label) if engines is not None else None
        rows.append({
            **v.as_dict(),
            "images": n,
            "tau": run.tau,
            "forwards_per_image": run.target_forwards / max(1, n),
            "wall_per_image_s": run.wall / max(1, n),
            "images_per_s": n / run.wall if run.wall > 0 else float("nan"),
            "baseline": baselines[v.batch_size],
            "speedup": stats[baselines[v.batch_size]].wall / run.wall if run.wall > 0 else float("nan"),
            "mean_accepted": run.mean_accepted,
            "tvd": run.tvd,
            "mean_tree_size": run.mean_tree_size,
            "tree": _tree_used(run, engine),
            "predicted_speedup": run.predicted_speedup,
            "phase_s_per_image": {p: seconds.get(p, 0.0) / max(1, n) for p in PHASES},
        })
        if engine is not None and engine.stack is not None:
            rows[-1]["resolved"] = {"delta": engine.stack.delta, "options": engine.stack.options_dict(), "budgeted": engine.stack.budgeted}
    summary: dict[str, Any] = {"images": n, "baseline": baseline, "variants": rows, "floors": {}, "notes": []}
    if quality is not None and n:
        samples = {label: torch.tensor([r["tokens"] for r in rs]) for label, rs in by_label.items()}
        scores, floors = quality.evaluate(samples, baseline)
        for row in rows:
            row["quality"] = {k: (m.as_dict() if hasattr(m, "as_dict") else m) for k, m in scores[row["label"]].items()}
        summary["floors"] = {k: (m.as_dict() if hasattr(m, "as_dict") else m) for k, m in floors.items()}
        summary["notes"] = list(quality.notes)
    return summary


def _tree_used(run: RunStats, engine: Engine | None) -> str:
    """An auto tree's most used shape (by steps), else the engine's tree in words."""
    steps = run.tree_steps()
    if steps and not (engine is not None and engine.own_tree):
        depth, topk, nodes = next(iter(steps))
        return "AR" if nodes == 1 else f"auto {depth}/{topk}/{nodes}"
    return tree_label(engine) if engine is not None else "-"


def tree_label(engine: Engine) -> str:
    """The tree ``engine`` drafts, in words."""
    config, hooks = engine.tree_config, engine.hooks
    if hooks is None:
        return "-"
    if engine.own_tree:
        return f"{hooks.propose.owner}'s own" + (", auto-sized" if engine.auto_tree else "")
    if config.kind == "auto":
        return "auto"
    if config.kind == "dynamic":
        return f"depth {config.depth}, top-k {config.topk}, {config.total_tokens} nodes"
    return f"chain of {config.depth}" if config.kind == "chain" else f"static, {len(config.rank_paths)} paths"


# ----------------------------------------------------------------------------- outputs

_QUALITY_COLUMNS = (
    ("frechet_real", "FD real"), ("frechet_ar", "FD vs AR"), ("fid", "FID"), ("accuracy", "acc"),
    ("clip", "CLIP"), ("loglik", "loglik/tok"),
)


def _q(row: Mapping[str, Any], key: str) -> float | None:
    m = row.get("quality", {}).get(key)  # a Frechet's dict, or a plain number
    return None if m is None else float(m["value"] if isinstance(m, Mapping) else m)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def markdown_table(summary: Mapping[str, Any]) -> str:
    rows = summary["variants"]
    cols = [c for c in _QUALITY_COLUMNS if any(_q(r, c[0]) is not None for r in rows)]
    head = ["method", "tree", "tau", "tvd", "fwd/img", "s/img", "img/s", "speedup", "predicted"] + [
        f"{name} (n={_n(rows, key)})" if key in ("frechet_real", "frechet_ar", "fid") else name for key, name in cols
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        predicted = r.get("predicted_speedup")
        cells = [
            r["label"], r.get("tree", "-"), _fmt(r["tau"]), _tvd(r), _fmt(r["forwards_per_image"], 1), _fmt(r["wall_per_image_s"], 2),
            _fmt(r["images_per_s"], 2), _fmt(r["speedup"]) + "x", "-" if predicted is None else _fmt(predicted) + "x",
        ]
        cells += [_fmt(_q(r, key), 3) if key in ("accuracy", "loglik") else _sig(_q(r, key)) for key, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _tvd(row: Mapping[str, Any]) -> str:
    """The budget spent; a rule with no budget (a paper mode) moves mass in its acceptance,
    which this measure does not see."""
    return _fmt(row.get("tvd"), 3) if row.get("resolved", {}).get("budgeted", True) else "no budget"


def _sig(x: float | None) -> str:
    """Distances: two decimals from 1 up, else three significant digits (tiny feature scales)."""
    return f"{x:.3g}" if x is not None and 0 < abs(x) < 1 else _fmt(x)


def _n(rows: Sequence[Mapping[str, Any]], key: str) -> str:
    for r in rows:
        m = r.get("quality", {}).get(key)
        if isinstance(m, Mapping):
            return f"{m['n_a']} vs {m['n_b']}"
    return "?"


CSV_FIELDS = (
    "label", "method", "sweep", "batch_size", "images", "tree", "tau", "tvd", "forwards_per_image", "wall_per_image_s", "images_per_s", "speedup", "predicted_speedup", "mean_accepted",
    "mean_tree_size", "frechet_real", "frechet_real_n", "frechet_ar", "fid", "fid_n", "accuracy", "clip", "loglik", "loglik_raw",
)


def csv_text(summary: Mapping[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in summary["variants"]:
        q = r.get("quality", {})
        row = {k: r.get(k) for k in CSV_FIELDS if k in r}
        row["sweep"] = ";".join(f"{k}={v}" for k, v in r["sweep"].items())
        for key in ("frechet_real", "frechet_ar", "fid", "accuracy", "clip", "loglik", "loglik_raw"):
            row[key] = _q(r, key)
        for key in ("frechet_real", "fid"):
            if isinstance(q.get(key), Mapping):
                row[f"{key}_n"] = q[key]["n_a"]
        w.writerow(row)
    return buf.getvalue()


def _write_atomic(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)


def scatter_plot(
    points: Sequence[tuple[str, float, float]],
    path: str | os.PathLike[str],
    x_label: str,
    y_label: str,
    title: str = "",
    hline: float | None = None,
) -> bool:
    """Write an 800x560 PNG: one labelled point per ``(label, x, y)`` (points with a
    non-finite coordinate are listed under the plot instead) and an optional dashed
    horizontal line.  False, and nothing written, when matplotlib is not installed.  It draws
    on a bare ``Figure`` (no pyplot), which renders with the Agg backend: headless, and
    without touching the backend of a notebook that imports specimg."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(8, 5.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    good = [(label, x, y) for label, x, y in points if math.isfinite(x) and math.isfinite(y)]
    for i, (label, x, y) in enumerate(good):
        colour = f"C{i % 10}"
        ax.scatter([x], [y], color=colour, edgecolors="black", zorder=3)
        ax.annotate(label, (x, y), xytext=(6, 4), textcoords="offset points", color=colour)
    if hline is not None:
        ax.axhline(hline, linestyle="--", color="0.55", linewidth=1)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(True, color="0.92")
    ax.margins(0.15)
    bad = [label for label, x, y in points if not (math.isfinite(x) and math.isfinite(y))]
    if bad:
        fig.supxlabel("not plotted (no value): " + ", ".join(bad), color="#aa0000", fontsize=9)
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, format="png")
    return True


def _plot(summary: Mapping[str, Any], path: str) -> tuple[str | None, bool]:
    """Plot speedup against the primary quality metric; (that metric, whether a plot was written)."""
    from specimg.eval.quality import LOWER_IS_BETTER, primary_metric

    rows = summary["variants"]
    metric = primary_metric({r["label"]: r.get("quality", {}) for r in rows})
    if metric is None:
        points = [(r["label"], r["tau"], r["speedup"]) for r in rows]
        x_label = "tau (tokens per target forward; no quality metric available)"
    else:
        points = [(r["label"], _q(r, metric) or float("nan"), r["speedup"]) for r in rows]
        names = {"fid": "FID", "frechet_real": "Frechet distance to real images (classifier features)",
                 "frechet_ar": "Frechet distance to AR samples (classifier features)", "loglik": "target log-likelihood per token"}
        n = f", n={_n(rows, metric)}" if metric in ("fid", "frechet_real", "frechet_ar") else ""
        x_label = f"{names[metric]}{n} ({'lower' if LOWER_IS_BETTER[metric] else 'higher'} is better)"
    plotted = scatter_plot(points, path, x_label, "speedup vs AR (x)", title=f"specimg bench: {summary['images']} images per method", hline=1.0)
    return metric, plotted


def write_outputs(summary: dict[str, Any], spec: BenchSpec, out: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """bench.json (everything), bench.csv (one row per variant), bench.md (the table) and,
    with matplotlib, bench.png (speedup against the primary quality metric); returns the
    paths written."""
    out = os.fspath(out)
    paths = {k: os.path.join(out, f"bench.{k}") for k in ("json", "csv", "md", "png")}
    metric, plotted = _plot(summary, paths["png"])
    if not plotted:
        del paths["png"]
    doc = {
        "format": FORMAT, "plot_metric": metric, **summary,
        "settings": {**spec.settings(str((extra or {}).get("model", ""))), "num_images": len(spec.conditions), "warmup": spec.warmup},
        "environment": {
            "torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
        },
        **(extra or {}),
    }
    safe = json.loads(json.dumps(doc), parse_constant=lambda _: None)  # JSON-safe: NaN and infinities as null
    _write_atomic(paths["json"], json.dumps(safe, indent=1) + "\n")
    _write_atomic(paths["csv"], csv_text(summary))
    _write_atomic(paths["md"], markdown_table(summary) + "\n")
    return paths


def save_sample_grid(records: Sequence[Mapping[str, Any]], spec: BenchSpec, tokenizer: Any, path: str, per_row: int = 8) -> None:
    """One row per variant, named on its left: its first ``per_row`` samples, the same
    conditions and seeds in every row, each column headed by its condition."""
    from specimg.runs.images import condition_label, decode_images, make_table, save_png_atomic

    columns = min(per_row, len(spec.conditions))
    rows = {v.label: {r["sample"]: r["tokens"] for r in records if r["label"] == v.label} for v in spec.variants}
    labels = [label for label, samples in rows.items() if all(i in samples for i in range(columns))]
    if not labels or not columns:
        return
    images = decode_images(tokenizer, torch.tensor([rows[label][i] for label in labels for i in range(columns)]))
    save_png_atomic(make_table(images, labels, [condition_label(spec.condition_keys[i]) for i in range(columns)]), path)
