"""The ``specimg`` command."""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import warnings
from typing import Any

import attrs
import click
import torch
from tqdm import tqdm

from specimg import costs
from specimg.cliopts import (
    DTYPES, IMAGES, SEED, THREADS, FiniteFloat, check_tree_fits, condition_options, cuda_graphs_option, device_from, device_options,
    method_options, model_options, prompt_options, sampling_from, sampling_options, tree_from, tree_options,
)
from specimg.config import LLAMAGEN_SAMPLING, Sampling, TreeConfig
from specimg.demo.recipe import DEFAULT_SCALE as DEFAULT_DEMO_SCALE
from specimg.demo.recipe import SCALES as DEMO_SCALES
from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.runfolder import claim, inputs_fingerprint
from specimg.eval.bench import DEFAULT_IMAGES as BENCH_IMAGES
from specimg.eval.conditions import Conditions, conditions_for, sample_captions, shorten
from specimg.eval.prompts import class_labels
from specimg.files import writable_folder
from specimg.methods import AR, parse_options
from specimg.models.eagle import DRAFTER_TYPES
from specimg.models.families import BUILT_IN_MODELS
from specimg.plugins import get_plugin_manager
from specimg.relax import BudgetError
from specimg.stats import ImageStats, RunStats
from specimg.train.drafter import TrainConfig


_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())
"""What click (8.2 and later) raises for a bare ``specimg``: the help, not a one-line error."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors end with one line on stderr and exit status 2, and so does
    a method that breaks its budget, naming the package to blame; warnings take one line."""
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        _run(argv)


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush of what a
    full disk refused does not add a traceback to the one error line."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _one_line_warning(message: Warning | str, *args: Any, **kwargs: Any) -> None:
    click.echo(f"specimg: warning: {message}", err=True)


def _run(argv: list[str] | None) -> None:
    try:
        cli.main(args=argv, prog_name="specimg", standalone_mode=False)
    except BudgetError as err:
        provider = get_plugin_manager().provider(err.method)
        origin = f"plugin {provider.name!r} ({provider.source})" if provider else "its plugin"
        click.echo(f"specimg: error: {err}, a bug in {origin}: leave {err.method} out of --method and report it to its authors", err=True)
        sys.exit(2)
    except SpecimgError as err:
        click.echo(f"specimg: error: {err}", err=True)
        sys.exit(2)
    except _NO_ARGS as err:
        err.show()
        sys.exit(2)
    except click.ClickException as err:
        hint = f" (see '{err.ctx.command_path} --help')" if isinstance(err, click.UsageError) and err.ctx else ""
        click.echo(f"specimg: error: {err.format_message()}{hint}", err=True)
        sys.exit(2)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        _quiet_stdout()
        where = f"{err.filename}: " if err.filename else "writing the output: "
        click.echo(f"specimg: error: {where}{err.strerror}; free space and run the same command again: it resumes", err=True)
        sys.exit(2)
    except (click.Abort, KeyboardInterrupt):
        click.echo("specimg: interrupted; the same command resumes where it stopped", err=True)
        sys.exit(130)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specimg")
def cli() -> None:
    """Speculative decoding with relaxed acceptance for autoregressive image models."""


@cli.command()
def plugins() -> None:
    """List installed plugins, where they come from and the methods they register; a
    faulty plugin is listed with its error (and left out everywhere else)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each fault is in the listing
        pm = get_plugin_manager()
    rows = [("plugin", "package", "methods", "module", "status")] + [
        (p.name, p.source, " ".join(p.methods) or "-", p.target, f"FAILED: {p.error}" if p.error else "ok") for p in pm.plugins
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])


@cli.command()
def methods() -> None:
    """List methods with their options and defaults."""
    click.echo(f"{AR:<12} plain autoregressive decoding, the baseline (core)")
    for name, spec in sorted(get_plugin_manager().methods().items()):
        click.echo(f"{name:<12} {spec.description}")
        for field in attrs.fields(spec.options):
            click.echo(f"    {name}.{field.name} = {field.default!r}")


@cli.command()
def models() -> None:
    """List the built-in models, the supported model families and presets, and how to point at each."""
    from specimg.models.demo import bundle_exists
    from specimg.models.families import catalogue

    for line in catalogue(demo_installed=bundle_exists()):
        click.echo(line)


def _overrides(pairs: tuple[str, ...], flag: str) -> dict[str, Any]:
    """``("block_size=576", "model_type=t2i")`` -> keyword overrides, values read as JSON
    where they parse (numbers, booleans, lists) and as strings otherwise."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecimgError(f"{flag} takes KEY=VALUE, not {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
        if isinstance(out[key], list):
            out[key] = tuple(out[key])
    return out


def _models(kw: dict[str, Any], model: str):
    """The models from paths (``--target``), else the built-in ``model``, whose drafter
    ``--drafter FILE`` may replace (one ``train-drafter --target demo`` made, say)."""
    from specimg.models import loading

    target, drafter, tokenizer = kw["target"], kw["drafter"], kw["tokenizer"]
    if target:
        return loading.from_paths(
            target, kw["preset"], drafter, tokenizer,
            _overrides(kw["target_config"], "--target-config"), _overrides(kw["tokenizer_config"], "--tokenizer-config"),
        )
    if tokenizer:
        raise SpecimgError(f"--tokenizer goes with --target: --model {model} brings its own tokenizer")
    for flag, given in (("--preset", kw["preset"]), ("--target-config", kw["target_config"]), ("--tokenizer-config", kw["tokenizer_config"])):
        if given:
            raise SpecimgError(f"{flag} shapes a --target checkpoint; --model {model} is built in and takes none")
    built_in = _built_in_models(model)
    if not drafter:
        return built_in
    from specimg.models.eagle import load_drafter

    return attrs.evolve(built_in, drafter=load_drafter(built_in.target, drafter), name=f"{built_in.name} with drafter {drafter}")


def _built_in_models(model: str):
    from specimg.models import loading

    if model == "tiny-random":
        return loading.tiny_random()
    if model in ("demo", "demo-cascade", "demo-eagle3"):
        from specimg.models.demo import load_demo

        return load_demo(drafter=model.partition("-")[2] or "plain")
    raise SpecimgError(f"unknown --model {model!r}; choose {', '.join(BUILT_IN_MODELS)}")


def _inputs(kw: dict[str, Any], model: str) -> dict[str, Any]:
    """The run's model inputs, fingerprinted for its settings: the files given (the demo:
    its bundle's) by content and every config override (see specimg.runfolder)."""
    files = {role: kw.get(role) for role in ("target", "drafter", "tokenizer", "text_encoder")}
    if not kw["target"] and model.startswith("demo"):
        from specimg.models.demo import bundle_dir

        files["demo_bundle"] = bundle_dir()
    configs = {
        "target": {**({"preset": kw["preset"]} if kw.get("preset") else {}), **_overrides(kw["target_config"], "--target-config")},
        "tokenizer": _overrides(kw["tokenizer_config"], "--tokenizer-config"),
    }
    return inputs_fingerprint(model if not kw["target"] else "checkpoint", files, configs)


def _default_model() -> str:
    from specimg.models.demo import bundle_exists

    return "demo" if bundle_exists() else "tiny-random"


def _base_sampling(model: str, path: str | None, target: Any) -> Sampling:
    """What unset sampling options default to: the demo bundle's measured sampling, else the
    target's own (``default_sampling``: LlamaGen c2i CFG 4, t2i CFG 7.5 and top-k 1000; Janus
    CFG 5; Lumina-mGPT CFG 4 and top-k 2000), else LlamaGen's c2i defaults."""
    if model.startswith("demo") and not path:
        from specimg.models.demo import demo_sampling

        return demo_sampling()
    return getattr(target, "default_sampling", LLAMAGEN_SAMPLING)


@cli.command()
@click.option("--method", "-m", default="naive", show_default=True, help="'ar' or a method stack such as cascade+lantern")
@method_options
@model_options
@condition_options(num_images=8)
@prompt_options
@sampling_options
@tree_options
@device_options
@cuda_graphs_option
@click.option("--out", type=click.Path(file_okay=False), default="out", show_default=True)
@click.option("--threads", type=THREADS, default=None, help="torch CPU threads [default: 1 for the built-in models, which one thread runs fastest; torch's choice for --target]")
def generate(**kw: Any) -> None:
    """Generate images and write PNGs, a labelled grid and a JSONL manifest.  A c2i target
    takes --class-labels, a t2i one --prompt / --prompts with --text-encoder.  Under
    `torchrun --nproc_per_node N -m specimg.cli generate ...` the images are dealt over
    the processes (the same images as one process gives; one manifest, resumable)."""
    from accelerate import PartialState

    device, dtype = device_from(kw)
    state = PartialState(cpu=device.type == "cpu")  # one process, or one per image slice under torchrun / accelerate launch
    device = _process_device(device, state)
    if kw["threads"] or not kw["target"]:  # after PartialState, which sets (cores / processes) threads
        torch.set_num_threads(kw["threads"] or 1)
    model = kw["model"] or _default_model()
    tree = tree_from(kw)
    models = _models(kw, model)
    check_tree_fits(tree, models.target, models.drafter)
    conditions = conditions_for(models.target, kw)
    if models.tokenizer is None and state.is_main_process:
        click.echo("specimg: note: no --tokenizer, so no PNGs: the manifest keeps the tokens (`specimg models` says what decodes each family)", err=True)
    engine = Engine(
        models.target, models.drafter, kw["method"], parse_options(kw["options"]),
        sampling_from(kw, _base_sampling(model, kw["target"], models.target)), tree,
        delta=kw["delta"], tokenizer=models.tokenizer, device=device, dtype=dtype, cuda_graphs=kw["cuda_graphs"],
    )
    _write_run(engine, models, conditions, kw["seed"], kw["out"], state, _inputs(kw, model))


@cli.command()
@click.option("--methods", default=None, help="comma-separated method stacks [default: ar,naive,lantern,lantern++,gsd,cascade,cascade+lantern, those installed]")
@click.option("--sweep", multiple=True, metavar="METHOD.KEY=V1,V2,...", help="one run per value, for each stack with METHOD (repeatable; delta=... sweeps the stack budget)")
@method_options
@model_options
@condition_options(num_images=BENCH_IMAGES)
@sampling_options
@tree_options
@device_options
@cuda_graphs_option
@prompt_options
@click.option("--classifier", type=click.Path(dir_okay=False), help="demo-format classifier for accuracy and Frechet distances [default: the demo bundle's]")
@click.option("--num-real", type=click.IntRange(2, 10**6), default=1000, show_default=True, help="reference images for Frechet distance / FID")
@click.option("--real-images", type=click.Path(file_okay=False), help="folder of reference images for FID")
@click.option("--fid-features", help="FID feature extractor: a TorchScript file, or inception:PATH (torch-fidelity weights)")
@click.option("--fid-size", type=click.IntRange(8, 4096), default=299, show_default=True, help="image side the FID extractor sees")
@click.option("--clip-model", type=click.Path(file_okay=False), help="local Hugging Face CLIP folder, for CLIP score with --prompts")
@click.option("--quality/--no-quality", default=True, show_default=True, help="compute quality metrics")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="images per method generated and discarded before timing")
@click.option("--threads", type=THREADS, default=1, show_default=True, help="torch CPU threads per process (more threads slow small models down on a busy machine)")
@click.option("--out", type=click.Path(file_okay=False), default="bench", show_default=True, help="output folder; a run started again on it resumes")
def bench(**kw: Any) -> None:
    """Benchmark methods side by side: tau, speedup against AR and quality, on the same
    conditions and seeds, interleaved.  Writes OUT/bench.{md,json,csv,png}.  Runs on
    several processes under `torchrun --nproc_per_node N -m specimg.cli bench ...`."""
    from specimg.eval.command import bench_command
    from specimg.models.loading import placed

    torch.set_num_threads(kw["threads"])
    device, dtype = device_from(kw)
    model = kw["model"] or _default_model()
    tree = tree_from(kw)
    models = placed(_models(kw, model), device, dtype)
    check_tree_fits(tree, models.target, models.drafter)
    writable_folder(kw["out"])
    real = None
    if model.startswith("demo") and not kw["target"]:  # the demo's real images are the quality reference
        from specimg.demo.data import real_images

        real = real_images
    sampling = sampling_from(kw, _base_sampling(model, kw["target"], models.target))
    bench_command(kw, models, model, sampling, tree, click.echo, real, inputs=_inputs(kw, model))


@cli.command()
@click.option("--method", "-m", default="naive", show_default=True, help="the method stack whose acceptance profile the candidate trees are valued with")
@method_options
@model_options
@condition_options(num_images=4)
@prompt_options
@sampling_options
@device_options
@cuda_graphs_option
@click.option("--remeasure", is_flag=True, help="measure the cost model again instead of reading the cached one")
@click.option("--threads", type=THREADS, default=None, help="torch CPU threads [default: 1 for the built-in models; torch's choice for --target]")
@click.option("--out", type=click.Path(file_okay=False), default="tune", show_default=True, help="folder for tune.json and tune.png")
def tune(**kw: Any) -> None:
    """Show what auto trees see on this machine: the cost curve, the method's acceptance
    profile (learnt from -n images drafted with a wide tree) and the best candidate trees
    by predicted speedup.  Writes OUT/tune.json and OUT/tune.png."""
    from specimg.eval.tune import tune as run_tune

    if kw["threads"] or not kw["target"]:
        torch.set_num_threads(kw["threads"] or 1)
    device, dtype = device_from(kw)
    model = kw["model"] or _default_model()
    models = _models(kw, model)
    if kw["method"].strip() == AR:
        raise SpecimgError("tune values draft trees: give a method that drafts (naive, cascade+lantern, ...)")
    engine = Engine(
        models.target, models.drafter, kw["method"], parse_options(kw["options"]), sampling_from(kw, _base_sampling(model, kw["target"], models.target)),
        TreeConfig(), delta=kw["delta"], tokenizer=models.tokenizer, device=device, dtype=dtype, cuda_graphs=kw["cuda_graphs"],
    )
    if engine.drafter_free:
        raise SpecimgError(f"tune values a drafter's trees; {engine.stack.drafter_free} drafts without one and sizes its own: give a method that drafts (naive, cascade+lantern, ...)")
    writable_folder(kw["out"])
    run_tune(engine, conditions_for(models.target, kw).values, kw["seed"], kw["out"], click.echo, remeasure=kw["remeasure"])


@cli.command("train-demo")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="folder for the bundle (resumed if it holds a partial run)")
@click.option("--scale", type=click.Choice(list(DEMO_SCALES)), default=DEFAULT_DEMO_SCALE, show_default=True,
              help="near-duplicate: the shipped demo; compact: the earlier 512-code one; diffuse: a 4096-code variant not shipped; toy: the same recipe at toy size, in seconds (see docs/demo.md)")
@click.option("--threads", type=THREADS, default=None, help="torch CPU threads [default: torch's choice]")
@click.option("--keep-work", is_flag=True, help="keep the intermediate token sets and samples in OUT/work")
def train_demo(out: str, scale: str, threads: int | None, keep_work: bool) -> None:
    """Re-create the embedded demo bundle from scratch: data, VQ, GPT, classifier, drafters."""
    from specimg.demo.recipe import train_demo as run_recipe

    try:
        import sklearn  # noqa: F401
        import skimage  # noqa: F401
    except ImportError as err:
        raise SpecimgError(f"train-demo needs the demo extra ({err.name} is missing): pip install 'specimg[demo]'") from None
    if threads is not None:
        torch.set_num_threads(threads)
    writable_folder(out)
    manifest = run_recipe(out, scale, log=lambda m: click.echo(m, err=True), keep_work=keep_work)
    q = manifest["stages"].get("quality", {})
    click.echo(
        f"demo bundle ({scale}) in {out}: {manifest['total_bytes'] / 1e6:.1f} MB, trained in {manifest['train_seconds']:.0f}s; "
        f"classifier accuracy: real {q.get('classifier_acc_real_test', float('nan')):.3f}, "
        f"AR samples at cfg {q.get('cfg_scale', float('nan'))} {q.get('classifier_acc_ar_samples', float('nan')):.3f}"
    )


def _write_run(engine: Engine, models: Any, conditions: Conditions, seed: int, out: str, state: Any, inputs: dict[str, Any]) -> None:
    """Generate the images ``out``'s manifest lacks, dealt over the processes of ``state``
    (image i to process i mod N: per-image seeds make them those of one process); every
    process appends to the one manifest; the main one writes the grid and the summary.
    The run owns ``out`` while it works (another run on it is refused)."""
    if state.is_main_process:
        writable_folder(out)
    with claim(out, state):
        _write_images(engine, models, conditions, seed, out, state, inputs)


def _write_images(engine: Engine, models: Any, conditions: Conditions, seed: int, out: str, state: Any, inputs: dict[str, Any]) -> None:
    from specimg.images import save_png_atomic, to_pil

    main, world = state.is_main_process, state.num_processes
    if main:
        os.makedirs(os.path.join(out, "images"), exist_ok=True)
    manifest = _open_manifest(engine, models, seed, out, state, inputs)
    key = "prompt" if conditions.prompts is not None else "condition"
    keys = conditions.keys
    other = next((i for i in sorted(manifest.done) if i < len(keys) and manifest.done[i].get(key) != keys[i]), None)
    if other is not None:
        there, here = manifest.done[other].get(key), keys[other]
        held = f"of class {there}, this run asks for class {here}: its --class-labels" if key == "condition" else f"for the prompt {there!r}, this run asks for {here!r}: its prompts"
        raise SpecimgError(f"{out} holds image {other} {held} differ; give another --out or remove {out}")
    todo = [i for i in range(len(keys)) if i not in manifest.done]
    if not todo:
        if main:
            click.echo(f"{engine.method}: {out} already holds these {len(keys)} images; nothing to do (more images: raise -n)")
        return
    engine.prepare(conditions.values[0], state)
    mine = todo[state.process_index :: world]
    images: list[ImageStats] = []
    start = time.perf_counter()
    with tqdm(total=len(mine) * models.target.num_tokens, unit="tok", desc=engine.method, disable=None if main else True) as bar:
        for index in mine:
            result = engine.generate([conditions.values[index]], seed=seed + index, progress=bar.update)
            image_stats = result.stats.images[0]
            images.append(image_stats)
            if models.tokenizer is not None:
                save_png_atomic(to_pil(_decode(models.tokenizer, result.tokens))[0], os.path.join(out, "images", f"{index:05d}.png"))
            manifest.add(index, {key: keys[index], "seed": seed + index, "tokens": result.tokens[0].tolist(), "stats": image_stats.as_dict()})
    if world > 1:
        from accelerate.utils import gather_object

        state.wait_for_everyone()
        images = gather_object(images)
    if main:
        _report(engine, models, manifest.path, RunStats(tuple(images)), len(todo), time.perf_counter() - start, out)


def _open_manifest(engine: Engine, models: Any, seed: int, out: str, state: Any, inputs: dict[str, Any]) -> Any:
    """The run's manifest, read by every process once the main one has repaired a cut last
    line; a refusal (other settings) stops every process alike."""
    from specimg.manifest import Manifest

    settings = {
        "model": models.name, "inputs": inputs, "method": engine.method,
        "options": engine.stack.options_dict() if engine.stack else {}, "delta": engine.stack.delta if engine.stack else 0.0,
        "sampling": attrs.asdict(engine.sampling), "tree": attrs.asdict(engine.tree_config), "seed": seed,
        "device": engine.device.type, "dtype": str(engine.target.input_embeddings().dtype),
    }
    if engine.auto_tree:  # auto trees depend on the cost model: a resumed run must use the same one
        settings["tree"]["cost_model"] = costs.cost_key(engine.target, engine.drafter, engine.sampling)[0]
    path = os.path.join(out, "manifest.jsonl")
    error = None
    if state.is_main_process:
        try:
            Manifest(path, settings)
        except SpecimgError as err:
            error = str(err)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error is not None:
        raise SpecimgError(error)
    manifest = Manifest(path, settings)
    state.wait_for_everyone()  # everyone has read the manifest before anyone appends
    return manifest


def _report(engine: Engine, models: Any, path: str, run: RunStats, images: int, wall: float, out: str) -> None:
    """The grid of every image in the manifest, and the run's summary lines."""
    from specimg.images import make_grid, save_png_atomic
    from specimg.manifest import read_entries

    if models.tokenizer is not None:
        entries = sorted(read_entries(path), key=lambda e: e["index"])
        codes = torch.tensor([e["tokens"] for e in entries])
        labels = [shorten(e["prompt"]) if "prompt" in e else f"class {e['condition']}" for e in entries]
        grid = make_grid(_decode(models.tokenizer, codes), nrow=min(8, len(entries)), labels=labels)
        save_png_atomic(grid, os.path.join(out, "grid.png"))
    s = engine.sampling
    click.echo(
        f"{engine.method}: tau {run.tau:.2f} | {run.target_forwards} target forwards for {run.tokens} tokens | {images} images in {wall:.2f}s "
        f"| cfg {s.cfg_scale:g}, temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g} -> {out}"
    )
    if engine.stack is not None:
        click.echo(f"tree: {_tree_summary(engine, run)}")


def _tree_summary(engine: Engine, stats: RunStats) -> str:
    """The tree a run used: auto trees by share of steps, with the cost model's prediction."""
    if not engine.auto_tree or engine.own_tree:
        return engine.tree_label
    steps = stats.trees()
    total = sum(steps.values()) or 1
    shares = ", ".join(f"{tree} ({100 * n / total:.0f}% of steps)" for tree, n in list(steps.items())[:3])
    assert engine.cost_model is not None and stats.predicted_speedup is not None
    return f"auto: {shares}; predicted speedup {stats.predicted_speedup:.2f}x (cost model {engine.cost_model.key}: {engine.cost_model.machine})"


def _process_device(device: torch.device, state: Any) -> torch.device:
    """``device``, or this process's GPU when several processes share ``--device cuda``."""
    return state.device if device.type == "cuda" and device.index is None else device


def _decode(tokenizer: Any, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return tokenizer.decode(codes)


# ----------------------------------------------------------------------------- drafter training


def _train_target(spec: str, preset: str | None, config: tuple[str, ...] = ()) -> Any:
    """``--target`` of the training commands: a checkpoint of any family (a LlamaGen file
    shaped by what it says, ``--preset`` and ``--target-config``; a Janus or Lumina-mGPT
    folder), ``demo`` (the embedded demo bundle's target) or ``tiny-random``."""
    overrides = _overrides(config, "--target-config")
    if overrides and spec in ("tiny-random", "demo"):
        raise SpecimgError(f"--target-config goes with a checkpoint path, not --target {spec}")
    if spec == "tiny-random":
        from specimg.models import loading

        return loading.tiny_random().target
    if spec == "demo":
        from specimg.models.demo import load_demo

        return load_demo().target
    from specimg.models.loading import load_given_target

    return load_given_target(spec, preset, overrides)


def _label_list(text: str | None, target: Any) -> tuple[int, ...]:
    if not text:
        return ()
    return tuple(class_labels(text, len([x for x in text.split(",") if x.strip()]), target.config.num_classes))


@cli.command("make-drafter-data")
@click.option("--target", required=True, help="a target checkpoint or folder (see `specimg models`), 'demo' or 'tiny-random'")
@click.option("--preset", default=None, help="LlamaGen preset of the --target checkpoint (GPT-B ... GPT-7B) [default: what the checkpoint says, else GPT-B]")
@click.option("--target-config", multiple=True, metavar="KEY=VALUE", help="a loading option: a GPTConfig field for LlamaGen (block_size=576), or dtype, device, attn_implementation (and image_size for Lumina-mGPT) for a Hugging Face folder")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="data folder (resumed if it holds the same run)")
@click.option("--tokens", "tokens_file", type=click.Path(dir_okay=False), help="teacher-force these sequences (safetensors: 'tokens' [M, N], optional 'labels' [M]) instead of sampling")
@click.option("--num-samples", "-n", type=IMAGES, help="images to sample (self-distillation) or to take from --tokens")
@click.option("--class-labels", help="comma-separated class ids, cycled over the samples [default: 0, 1, 2, ...]")
@prompt_options
@click.option("--seed", type=SEED, default=0, show_default=True, help="sample i uses seed + i")
@sampling_options
@click.option("--uncond/--no-uncond", default=None, help="also store every sequence under the null class [default: when the target has one]")
@device_options
@click.option("--feature-dtype", type=click.Choice(list(DTYPES)), default=None, help="storage type of the features [default: --dtype]")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True, help="images sampled / teacher-forced at once")
@click.option("--shard-size", type=click.IntRange(min=1), default=256, show_default=True, help="images per shard file")
@click.option("--drafter-type", type=click.Choice(list(DRAFTER_TYPES)), default="eagle1", show_default=True, help="eagle3: also store the target's low, middle and high layers (an EAGLE-3 drafter's input; it serves eagle1 too)")
def make_drafter_data_command(**kw: Any) -> None:
    """Generate drafter training data once: the target's teacher-forced features on
    self-sampled (or given) token sequences, as safetensors shards.  A c2i target samples
    under --class-labels, a t2i one under --prompt / --prompts with --text-encoder.  Runs
    on several processes under `accelerate launch`."""
    from accelerate import PartialState

    from specimg.train.data import DataSpec, make_drafter_data

    writable_folder(kw["out"])
    device, dtype = device_from(kw)
    state = PartialState(cpu=device.type == "cpu")
    target = _train_target(kw["target"], kw["preset"], kw["target_config"]).to(_process_device(device, state), dtype)
    sampling = sampling_from(kw, _base_sampling(kw["target"], None, target))
    captions, prompts = sample_captions(target, kw)
    spec = DataSpec(
        num_samples=kw["num_samples"], labels=_label_list(kw["class_labels"], target),
        captions=captions, prompts=prompts,
        tokens_file=kw["tokens_file"], sampling=sampling, seed=kw["seed"], uncond=kw["uncond"], dtype=kw["feature_dtype"] or kw["dtype"],
        shard_size=kw["shard_size"], batch_size=kw["batch_size"], drafter_type=kw["drafter_type"],
    )
    start = time.perf_counter()
    with claim(kw["out"], state), tqdm(unit="img", desc="drafter data", disable=None if state.is_main_process else True) as bar:
        meta = make_drafter_data(
            target, kw["out"], spec, process_index=state.process_index, num_processes=state.num_processes,
            barrier=state.wait_for_everyone, progress=bar.update,
        )
    if state.is_main_process:
        click.echo(
            f"{meta['num_examples']} examples ({meta['settings']['num_samples']} images x {1 + meta['settings']['uncond']} rows) "
            f"in {meta['num_shards']} shards, {time.perf_counter() - start:.1f}s -> {kw['out']}"
        )


@cli.command("train-drafter")
@click.option("--target", required=True, help="a target checkpoint or folder (see `specimg models`), 'demo' or 'tiny-random' (the one that made --data)")
@click.option("--preset", default=None, help="LlamaGen preset of the --target checkpoint (GPT-B ... GPT-7B) [default: what the checkpoint says, else GPT-B]")
@click.option("--target-config", multiple=True, metavar="KEY=VALUE", help="a loading option: a GPTConfig field for LlamaGen (block_size=576), or dtype, device, attn_implementation (and image_size for Lumina-mGPT) for a Hugging Face folder")
@click.option("--data", required=True, type=click.Path(file_okay=False), help="a folder made by make-drafter-data")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="run folder; a run started again on it resumes")
@click.option("--method", "-m", default=None, help="method stack whose train_loss hooks reweight the loss, e.g. cascade")
@click.option("--option", "-o", "options", multiple=True, metavar="METHOD.KEY=VALUE", help="a method option (repeatable)")
@click.option("--drafter-type", type=click.Choice(list(DRAFTER_TYPES)), default="eagle1", show_default=True, help="eagle3 needs data made with --drafter-type eagle3")
@click.option("--ttt-steps", type=click.IntRange(1, 16), default=TrainConfig().ttt_steps, show_default=True, help="EAGLE-3's unrolled training-time-test steps")
@click.option("--init", type=click.Path(dir_okay=False), help="start from these drafter weights (safetensors)")
@click.option("--steps", type=click.IntRange(min=1), default=TrainConfig().steps, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=TrainConfig().batch_size, show_default=True, help="global batch (all processes), in images")
@click.option("--lr", type=FiniteFloat(min=0.0, min_open=True), default=TrainConfig().lr, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=None, help="warmup steps [default: 5% of --steps]")
@click.option("--min-lr-ratio", type=FiniteFloat(0.0, 1.0), default=0.0, show_default=True, help="cosine floor, as a fraction of --lr")
@click.option("--weight-decay", type=FiniteFloat(min=0.0), default=0.0, show_default=True)
@click.option("--w-cls", type=FiniteFloat(min=0.0), default=None, help="weight of the soft cross-entropy [default: 0.1, EAGLE-1's p_w; 1.0 for eagle3]")
@click.option("--w-reg", type=FiniteFloat(min=0.0), default=1.0, show_default=True, help="weight of the SmoothL1 feature regression (EAGLE v_w)")
@click.option("--clip-value", type=FiniteFloat(min=0.0, min_open=True), default=0.5, show_default=True, help="clip gradient values (EAGLE)")
@click.option("--clip-norm", type=FiniteFloat(min=0.0, min_open=True), default=None, help="clip the gradient norm")
@click.option("--noise", type=FiniteFloat(min=0.0), default=0.0, show_default=True, help="width of uniform noise on the input features")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--keep-checkpoints", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--log-every", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--mixed-precision", type=click.Choice(["no", "fp16", "bf16"]), default="no", show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True, help="drafter init and data order")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto (a GPU when there is one; under accelerate launch, one per process)")
def train_drafter_command(**kw: Any) -> None:
    """Train an EAGLE-1 or EAGLE-3 drafter on drafter data (accelerate: `accelerate launch -m
    specimg.cli train-drafter ...` for several GPUs).  Writes OUT/drafter.safetensors."""
    from accelerate import Accelerator

    from specimg.train.drafter import train_drafter

    config = TrainConfig(
        steps=kw["steps"], batch_size=kw["batch_size"], lr=kw["lr"], weight_decay=kw["weight_decay"], warmup_steps=kw["warmup"],
        min_lr_ratio=kw["min_lr_ratio"], w_reg=kw["w_reg"], clip_value=kw["clip_value"], **({"w_cls": kw["w_cls"]} if kw["w_cls"] is not None else {}),
        clip_norm=kw["clip_norm"], noise=kw["noise"], checkpoint_every=kw["checkpoint_every"],
        keep_checkpoints=kw["keep_checkpoints"], log_every=kw["log_every"], seed=kw["seed"],
        mixed_precision=kw["mixed_precision"], drafter_type=kw["drafter_type"], ttt_steps=kw["ttt_steps"],
    )
    writable_folder(kw["out"])
    target = _train_target(kw["target"], kw["preset"], kw["target_config"])
    accelerator = Accelerator(mixed_precision=config.mixed_precision, cpu=device_from(kw)[0].type == "cpu")
    start = time.perf_counter()
    result = train_drafter(
        target, kw["data"], kw["out"], config, method=kw["method"], options=parse_options(kw["options"]), accelerator=accelerator,
    )
    if accelerator.is_main_process:
        click.echo(f"{result.steps} steps in {time.perf_counter() - start:.1f}s -> {result.path}")


if __name__ == "__main__":
    main()
