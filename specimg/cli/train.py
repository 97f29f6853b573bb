"""The training commands: ``train-demo`` (the demo bundle), ``make-drafter-data`` and
``train-drafter``."""

from __future__ import annotations

import time
from typing import Any

import attrs
import click
import torch

from specimg.cli.conditions import sample_captions
from specimg.cli.loading import base_sampling, process_state, train_target
from specimg.cli.options import (
    DTYPES, IMAGES, METHOD_OPTION, PRESET, SEED, TARGET_CONFIG, THREADS, FiniteFloat, device_from, device_options, prompt_options, sampling_from,
    sampling_options,
)
from specimg.cli.prompts import class_labels, comma_items
from specimg.demo.recipe import DEFAULT_SCALE as DEFAULT_DEMO_SCALE
from specimg.demo.recipe import SCALES as DEMO_SCALES
from specimg.errors import SpecimgError
from specimg.files import writable_folder
from specimg.methods import parse_options
from specimg.models.eagle import DRAFTER_TYPES
from specimg.progress import progress_bar
from specimg.runs.folder import claim
from specimg.train.drafter import TrainConfig


@click.command("train-demo")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="folder for the bundle (resumed if it holds a partial run)")
@click.option("--scale", type=click.Choice(list(DEMO_SCALES)), default=DEFAULT_DEMO_SCALE, show_default=True,
              help="interchangeable: the shipped demo; near-duplicate: the same codebook, the target trained on the encoder's siblings; compact: 512 codes; toy: the same recipe at toy size, in seconds (see docs/demo.md)")
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


@click.command("make-drafter-data")
@click.option("--target", required=True, help="a target checkpoint or folder (see `specimg models`), 'demo' or 'tiny-random'")
@PRESET
@TARGET_CONFIG
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
    from specimg.train.data import DataSpec, make_drafter_data

    writable_folder(kw["out"])
    state, device, dtype = process_state(kw)
    target = train_target(kw["target"], kw["preset"], kw["target_config"]).to(device, dtype)
    sampling = sampling_from(kw, base_sampling(kw["target"], None, target))
    captions, prompts = sample_captions(target, kw)
    labels = kw["class_labels"]  # checked against the target, each once
    spec = DataSpec(
        num_samples=kw["num_samples"], captions=captions, prompts=prompts,
        labels=tuple(class_labels(labels, len(comma_items(labels, "--class-labels")), target.config.num_classes)) if labels else (),
        tokens_file=kw["tokens_file"], sampling=sampling, seed=kw["seed"], uncond=kw["uncond"], dtype=kw["feature_dtype"] or kw["dtype"],
        shard_size=kw["shard_size"], batch_size=kw["batch_size"], drafter_type=kw["drafter_type"],
    )
    start = time.perf_counter()
    with claim(kw["out"], state), progress_bar(unit="img", desc="drafter data", show=state.is_main_process) as bar:
        meta = make_drafter_data(
            target, kw["out"], spec, process_index=state.process_index, num_processes=state.num_processes,
            barrier=state.wait_for_everyone, progress=bar.update, progress_total=lambda n: setattr(bar, "total", n),
        )
    if state.is_main_process:
        click.echo(
            f"{meta['num_examples']} examples ({meta['settings']['num_samples']} images x {1 + meta['settings']['uncond']} rows) "
            f"in {meta['num_shards']} shards, {time.perf_counter() - start:.1f}s -> {kw['out']}"
        )


@click.command("train-drafter")
@click.option("--target", required=True, help="a target checkpoint or folder (see `specimg models`), 'demo' or 'tiny-random' (the one that made --data)")
@PRESET
@TARGET_CONFIG
@click.option("--data", required=True, type=click.Path(file_okay=False), help="a folder made by make-drafter-data")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="run folder; a run started again on it resumes")
@click.option("--method", "-m", default=None, help="method stack whose train_loss hooks reweight the loss, e.g. cascade")
@METHOD_OPTION
@click.option("--drafter-type", type=click.Choice(list(DRAFTER_TYPES)), default="eagle1", show_default=True, help="eagle3 needs data made with --drafter-type eagle3")
@click.option("--ttt-steps", type=click.IntRange(1, 16), default=TrainConfig().ttt_steps, show_default=True, help="EAGLE-3's unrolled training-time-test steps (EAGLE-3's own 7)")
@click.option("--init", type=click.Path(dir_okay=False), help="start from these drafter weights (safetensors)")
@click.option("--steps", type=click.IntRange(min=1), default=TrainConfig().steps, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=TrainConfig().batch_size, show_default=True, help="global batch (all processes), in images")
@click.option("--lr", type=FiniteFloat(min=0.0, min_open=True), default=None, help="[default: the drafter type's published one: eagle1 3e-5, eagle3 5e-5]")
@click.option("--warmup", "warmup_steps", type=click.IntRange(min=0), default=None, help="warmup steps [default: 5% of --steps]")
@click.option("--min-lr-ratio", type=FiniteFloat(0.0, 1.0), default=0.0, show_default=True, help="cosine floor, as a fraction of --lr")
@click.option("--weight-decay", type=FiniteFloat(min=0.0), default=0.0, show_default=True)
@click.option("--w-cls", type=FiniteFloat(min=0.0), default=None, help="weight of the soft cross-entropy [default: 0.1, EAGLE-1's p_w; 1.0 for eagle3]")
@click.option("--w-reg", type=FiniteFloat(min=0.0), default=1.0, show_default=True, help="weight of the SmoothL1 feature regression (EAGLE v_w)")
@click.option("--clip-value", type=FiniteFloat(min=0.0), default=None, help="clip gradient values; 0: off [default: eagle1 0.5 (EAGLE-1), eagle3 off]")
@click.option("--clip-norm", type=FiniteFloat(min=0.0), default=None, help="clip the gradient norm; 0: off [default: eagle1 off, eagle3 0.5 (EAGLE-3)]")
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

    fields = {field.name for field in attrs.fields(TrainConfig)}  # each option sets the field of its name
    given = {key: value for key, value in kw.items() if key in fields and value is not None}  # unset: the drafter type's published value
    given |= {key: kw[key] or None for key in ("clip_value", "clip_norm") if kw[key] is not None}  # 0: off
    config = TrainConfig(**given)
    writable_folder(kw["out"])
    target = train_target(kw["target"], kw["preset"], kw["target_config"])
    accelerator = Accelerator(mixed_precision=config.mixed_precision, cpu=device_from(kw)[0].type == "cpu")
    start = time.perf_counter()
    result = train_drafter(
        target, kw["data"], kw["out"], config, method=kw["method"], options=parse_options(kw["options"]), init=kw["init"], accelerator=accelerator,
    )
    if accelerator.is_main_process:
        click.echo(f"{result.steps} steps in {time.perf_counter() - start:.1f}s -> {result.path}")
