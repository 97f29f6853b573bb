"""``specimg generate``: images into a run folder, resumable and dealt over processes."""

from __future__ import annotations

import os
import time
from typing import Any

import attrs
import click
import torch

from specimg import costs, payoff
from specimg.cli.conditions import Conditions, conditions_for, grid_label
from specimg.cli.loading import base_sampling, default_model, models_from, process_state, run_inputs
from specimg.cli.options import THREADS, check_tree_fits, run_options, sampling_from, tree_from
from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.eval.bench import tree_label
from specimg.methods import parse_options
from specimg.progress import progress_bar
from specimg.runs.log import RunLog, open_run
from specimg.stats import ImageStats, RunStats


@click.command()
@click.option("--method", "-m", default="naive", show_default=True, help="'ar' or a method stack such as cascade+lantern")
@run_options(num_images=8)
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="images decoded together on a LlamaGen target: one target forward per step verifies every image's tree (AR: one per token)")
@click.option("--out", type=click.Path(file_okay=False), default="out", show_default=True)
@click.option("--threads", type=THREADS, default=None, help="torch CPU threads [default: 1 for the built-in models, which one thread runs fastest; torch's choice for --target]")
def generate(**kw: Any) -> None:
    """Generate images and write PNGs, a labelled grid and a JSONL manifest.  A c2i target
    takes --class-labels, a t2i one --prompt / --prompts with --text-encoder.  Under
    `torchrun --nproc_per_node N -m specimg.cli generate ...` the images are dealt over
    the processes (the same images as one process gives; resumable on any process count)."""
    state, device, dtype = process_state(kw)
    if kw["threads"] or not kw["target"]:  # after PartialState, which sets (cores / processes) threads
        torch.set_num_threads(kw["threads"] or 1)
    model = kw["model"] or default_model()
    tree = tree_from(kw)
    models = models_from(kw, model)
    check_tree_fits(tree, models.target, models.drafter)
    conditions = conditions_for(models.target, kw)
    if models.tokenizer is None and state.is_main_process:
        click.echo("specimg: note: no --tokenizer, so no PNGs: the manifest keeps the tokens (`specimg models` says what decodes each family)", err=True)
    engine = Engine(
        models.target, models.drafter, kw["method"], parse_options(kw["options"]),
        sampling_from(kw, base_sampling(model, kw["target"], models.target)), tree,
        delta=kw["delta"], tokenizer=models.tokenizer, device=device, dtype=dtype, compile=kw["compile"],
        batch_size=min(kw["batch_size"], len(conditions.keys)),  # planned, calibrated and run at no more than the images
    )
    write_run(engine, models, conditions, kw["seed"], kw["out"], state, run_inputs(kw, model))


def write_run(engine: Engine, models: Any, conditions: Conditions, seed: int, out: str, state: Any, inputs: dict[str, Any]) -> None:
    """Generate the images ``out`` lacks, dealt over the processes of ``state`` (image i to
    process i mod N: per-image seeds make them those of one process); the main process
    writes the grid and the summary.  The run owns ``out`` while it works."""
    settings = {  # what decides the images: a folder holding images made otherwise is refused
        "model": models.name, "inputs": inputs, "method": engine.method,
        "options": engine.stack.options_dict() if engine.stack else {}, "delta": engine.stack.delta if engine.stack else 0.0,
        "budgeted": engine.stack.budgeted if engine.stack else True,
        "sampling": attrs.asdict(engine.sampling), "tree": attrs.asdict(engine.tree_config), "seed": seed,
        "device": engine.device.type, "dtype": str(engine.target.input_embeddings().dtype),
    }
    if engine.auto_tree:  # auto trees depend on the cost model: a resumed run must use the same one
        settings["tree"]["cost_model"] = costs.cost_key(engine.target, engine.drafter, engine.sampling)[0]
    with open_run(out, settings, state) as log:
        mismatch = log.first_mismatch([{conditions.field: k} for k in conditions.keys])
        if mismatch is not None:
            index, _, there, here = mismatch
            if conditions.field == "condition":
                held = f"of class {there}, this run asks for class {here}: its --class-labels"
            else:  # the folder may hold the prompt as text and this run give it as ids, or the other way round
                entry = log.done[index]
                held = f"for the prompt {entry.get('prompt', entry.get('prompt_ids'))!r}, this run asks for {here!r}: its prompts"
            raise SpecimgError(f"{log.out} holds image {index} {held} differ; give another --out or remove {log.out}")
        todo = [i for i in range(len(conditions.keys)) if i not in log.done]
        if not todo:
            if state.is_main_process:
                click.echo(f"{engine.method}: {out} already holds these {len(conditions.keys)} images; nothing to do (more images: raise -n)")
            return
        engine.prepare(conditions.values[0], state)
        start = time.perf_counter()
        images = _write_images(engine, models, conditions, seed, log, todo[state.process_index :: state.num_processes], state.is_main_process)
        if state.num_processes > 1:
            from accelerate.utils import gather_object

            state.wait_for_everyone()
            images = gather_object(images)
        if state.is_main_process:
            _report(engine, models, log, RunStats(tuple(images)), len(todo), time.perf_counter() - start)


def _write_images(engine: Engine, models: Any, conditions: Conditions, seed: int, log: RunLog, mine: list[int], main: bool) -> list[ImageStats]:
    from specimg.runs.images import decode_images, save_png_atomic, to_pil

    images: list[ImageStats] = []

    def write(position: int, tokens: torch.Tensor, stats: ImageStats) -> None:
        """Each image as soon as it is done: a killed run keeps every finished one."""
        index = mine[position]
        images.append(stats)
        if models.tokenizer is not None:
            save_png_atomic(to_pil(decode_images(models.tokenizer, tokens[None]))[0], os.path.join(log.out, "images", f"{index:05d}.png"))
        log.add(index, {conditions.field: conditions.keys[index], "seed": seed + index, "tokens": tokens.tolist(), "stats": stats.as_dict()})

    with progress_bar(total=len(mine) * models.target.num_tokens, unit="tok", desc=engine.method, show=main) as bar:
        engine.generate([conditions.values[i] for i in mine], seeds=[seed + i for i in mine], progress=bar.update, on_image=write)
    return images


def _report(engine: Engine, models: Any, log: RunLog, run: RunStats, images: int, wall: float) -> None:
    """The grid of every image in the folder, and the run's summary lines (the images'
    time apart from the first run's measuring of what trees cost, which it would inflate;
    per target forward, each image's own decode time, so also under several processes)."""
    from specimg.runs.images import decode_images, make_grid, save_png_atomic

    if models.tokenizer is not None:
        entries = log.all_entries()
        codes = torch.tensor([e["tokens"] for e in entries])
        labels = [grid_label(e) for e in entries]
        grid = make_grid(decode_images(models.tokenizer, codes), nrow=min(8, len(entries)), labels=labels)
        save_png_atomic(grid, os.path.join(log.out, "grid.png"))
    s = engine.sampling
    batches = f" (batches of {engine.batch_size})" if engine.batch_size > 1 else ""
    share = " (an image's share)" if engine.batch_size > 1 else ""
    click.echo(
        f"{engine.method}: tau {run.tau:.2f} | {run.target_forwards} target forwards for {run.tokens} tokens | {images} images in {wall:.2f}s"
        f"{batches}, {1000 * run.wall / max(1, run.target_forwards):.1f} ms a target forward{share}"
        f"{f' (after {engine.calibration_seconds:.1f}s measuring what trees cost on this machine; cached)' if engine.calibration_seconds else ''} "
        f"| cfg {s.cfg_scale:g}, temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g} -> {log.out}"
    )
    if engine.stack is None:
        return
    if not engine.auto_tree or engine.own_tree:
        click.echo(f"tree: {tree_label(engine)}")
        return
    # auto trees by share of steps, with the cost model's prediction, this run's own step times, and in plain words whether speculation paid
    assert engine.cost_model is not None and run.predicted_speedup is not None
    cost = engine.cost_model
    click.echo(f"tree: auto: {run.tree_shares()}; predicted speedup {run.predicted_speedup:.2f}x (cost model {cost.key}: {cost.machine})")
    for line in [payoff.measured(run), *payoff.verdict(cost, run, costs.scale_key(engine.stack))]:
        click.echo(line)
