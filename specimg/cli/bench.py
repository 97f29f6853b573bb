"""``specimg bench``: the models and conditions the flags name, the variants, the run
(:func:`specimg.eval.bench.run_bench`), quality, and the outputs."""

from __future__ import annotations

import os
import time
from typing import Any

import click
import torch

from specimg import costs
from specimg.cli.conditions import conditions_for
from specimg.cli.loading import base_sampling, default_model, models_from, run_inputs
from specimg.cli.options import THREADS, check_tree_fits, device_from, run_options, sampling_from, tree_from
from specimg.cli.prompts import comma_items
from specimg.config import Sampling
from specimg.errors import SpecimgError
from specimg.eval.bench import (
    DEFAULT_IMAGES, DEFAULT_METHODS, MISSING_PLOT, BenchSpec, build_engines, markdown_table, plan_variants, run_bench, save_sample_grid,
    summarise, write_outputs,
)
from specimg.methods import parse_options
from specimg.plugins import get_plugin_manager
from specimg.runs.folder import on_main
from specimg.files import writable_folder
from specimg.compiled import CompileClock
from specimg.relax import checks_enabled


@click.command()
@click.option("--methods", default=None, help=f"comma-separated method stacks [default: {','.join(DEFAULT_METHODS)}, those installed]")
@click.option("--sweep", multiple=True, metavar="METHOD.KEY=V1,V2,...", help="one run per value, for each stack with METHOD (repeatable; delta=... sweeps the stack budget)")
@run_options(num_images=DEFAULT_IMAGES)
@click.option("--classifier", type=click.Path(dir_okay=False), help="demo-format classifier for accuracy and Frechet distances [default: the demo bundle's]")
@click.option("--num-real", type=click.IntRange(2, 10**6), default=1000, show_default=True, help="reference images for Frechet distance / FID")
@click.option("--real-images", type=click.Path(exists=True, file_okay=False), help="folder of reference images for FID")
@click.option("--fid-features", help="FID feature extractor: a TorchScript file, or inception:PATH (torch-fidelity weights)")
@click.option("--fid-size", type=click.IntRange(8, 4096), default=299, show_default=True, help="image side the FID extractor sees")
@click.option("--clip-model", type=click.Path(file_okay=False), help="local Hugging Face CLIP folder, for CLIP score with --prompts")
@click.option("--quality/--no-quality", default=True, show_default=True, help="compute quality metrics")
@click.option("--batch-size", "batch_sizes", default="1", show_default=True, metavar="B1,B2,...",
              help="images decoded together; several sizes run every method at each, against AR at the same size")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="images per method generated and discarded before timing")
@click.option("--threads", type=THREADS, default=1, show_default=True, help="torch CPU threads per process (more threads slow small models down on a busy machine)")
@click.option("--out", type=click.Path(file_okay=False), default="bench", show_default=True, help="output folder; a run started again on it resumes")
def bench(**kw: Any) -> None:
    """Benchmark methods side by side: tau, speedup against AR and quality, on the same
    conditions and seeds, interleaved.  Writes OUT/bench.{md,json,csv,png}.  Runs on
    several processes under `torchrun --nproc_per_node N -m specimg.cli bench ...`."""
    from accelerate import PartialState

    from specimg.models.loading import placed

    torch.set_num_threads(kw["threads"])
    device, dtype = device_from(kw)
    model = kw["model"] or default_model()
    tree = tree_from(kw)
    models = placed(models_from(kw, model), device, dtype)
    check_tree_fits(tree, models.target, models.drafter)
    sizes = batch_sizes(kw["batch_sizes"])
    writable_folder(kw["out"])
    sampling = sampling_from(kw, base_sampling(model, kw["target"], models.target))
    start = time.perf_counter()
    state = PartialState(cpu=True)
    # accelerate sets (host physical cores / processes) threads on multi-CPU runs, far too
    # many in a container: keep --threads (default 1)
    torch.set_num_threads(kw["threads"])
    methods = comma_items(kw["methods"], "--methods") if kw["methods"] is not None else None  # '' names no method, not the defaults
    variants, notes = plan_variants(methods, get_plugin_manager().methods(), parse_options(kw["options"]), kw["sweep"], kw["delta"], sizes)
    conditions, keys, captions = conditions_for(models.target, kw)
    spec = BenchSpec(tuple(variants), tuple(conditions), tuple(keys), kw["seed"], sampling, tree, kw["warmup"], run_inputs(kw, model))
    engines = build_engines(models, spec, compile=kw["compile"])
    quality = on_main(state, lambda: build_quality(models, model, sampling, conditions, captions, kw) if kw["quality"] else None)
    if state.is_main_process:
        for note in notes:
            click.echo(f"note: {note}")
    run = run_bench(models, spec, kw["out"], state=state, engines=engines)
    if not state.is_main_process:
        return
    summary = summarise(run.records, spec, quality, run.engines)
    extra = {
        "model": models.name, "num_processes": state.num_processes, "computed_this_run": run.computed,
        "runtime_s": round(time.perf_counter() - start, 1), "plan_notes": notes,
        "relax_checks": checks_enabled(), "device": str(costs.device_of(models.target)), "threads": torch.get_num_threads(),
    }
    if hasattr(models.target, "step_mode"):
        extra["step"] = {"mode": models.target.step_mode, "compile_s": round(CompileClock.seconds, 3)}
    cost_model = next((e.cost_model for e in run.engines.values() if e.cost_model is not None), None)
    if cost_model is not None:
        extra["cost_model"] = {"key": cost_model.key, "machine": cost_model.machine}
    paths = write_outputs(summary, spec, kw["out"], extra)
    if models.tokenizer is not None:
        save_sample_grid(run.records, spec, models.tokenizer, os.path.join(kw["out"], "samples.png"))
    click.echo(markdown_table(summary))
    for note in summary.get("notes", []):
        click.echo(f"note: {note}")
    if "png" not in paths:
        click.echo(f"note: {MISSING_PLOT}")
    for key, what in (("frechet_real", "real vs real"), ("frechet_ar", "AR vs AR on other seeds")):
        floor = summary["floors"].get(key)
        if floor is not None:
            click.echo(f"Frechet floor ({what} at n={floor['n_a']} vs {floor['n_b']}): {floor['value']:.2f}")
    seconds = time.perf_counter() - start
    click.echo(f"{summary['images']} images per method, {len(spec.variants)} methods, {seconds:.0f}s -> {', '.join(paths.values())}")


def batch_sizes(text: str) -> list[int]:
    """``"1,4,16"`` -> [1, 4, 16] (:func:`plan_variants` checks that they are distinct and positive)."""
    try:
        return [int(t) for t in comma_items(text, "--batch-size")]
    except ValueError:
        raise SpecimgError(f"--batch-size takes sizes such as 1,4,16, not {text!r}") from None


def build_quality(models: Any, model_name: str, sampling: Sampling, conditions: list[Any], captions: list[str] | None, kw: dict[str, Any]) -> Any:
    """The :class:`~specimg.eval.quality.Quality` scorer the flags ask for; the demo's real
    images (``real(n, seed)``) are its reference when the models are the demo's."""
    from specimg.eval.classifier import load_classifier
    from specimg.eval.quality import Quality

    real = None
    if model_name.startswith("demo") and not kw["target"]:
        from specimg.demo.data import real_images as real
    classifier = load_classifier(kw["classifier"]) if kw["classifier"] else None
    if classifier is None and real is not None:
        from specimg.models.demo import bundle_dir

        path = os.path.join(bundle_dir(), "classifier.safetensors")
        classifier = load_classifier(path) if os.path.isfile(path) else None
    fid = None
    if kw.get("real_images") and not kw.get("fid_features"):
        raise SpecimgError("--real-images is the reference of FID: give --fid-features too")
    if kw.get("fid_features"):
        from specimg.eval.fid import FID, load_feature_extractor, read_image_folder, to_uint8

        extractor = load_feature_extractor(kw["fid_features"], kw.get("fid_size", 299))
        if kw.get("real_images"):
            reference = read_image_folder(kw["real_images"], kw.get("fid_size", 299), kw.get("num_real"))
        elif real is not None:
            reference = to_uint8(real(kw.get("num_real", 1000), 7_000))
        else:
            raise SpecimgError("--fid-features needs --real-images (a folder of reference images)")
        fid = FID(extractor, reference)
    clip = None
    if kw.get("clip_model"):
        if captions is None:
            raise SpecimgError("--clip-model scores captions: it needs --prompts")
        from specimg.eval.clip import CLIPScorer

        clip = CLIPScorer(kw["clip_model"])
    return Quality(
        models.target, models.tokenizer, sampling, conditions, classifier=classifier, real_images=real,
        num_real=kw.get("num_real", 1000), fid=fid, clip=clip, captions=captions,
    )
