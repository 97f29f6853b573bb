"""The ``specimg`` command."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import attrs
import click
import torch
from tqdm import tqdm

from specimg.config import Sampling, TreeConfig
from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.methods import AR, parse_options
from specimg.plugins import get_plugin_manager


def main() -> None:
    """Entry point: user errors end with one line on stderr and exit status 2."""
    try:
        cli.main(standalone_mode=False)
    except SpecimgError as err:
        click.echo(f"specimg: error: {err}", err=True)
        sys.exit(2)
    except click.ClickException as err:
        err.show()
        sys.exit(2)
    except click.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specimg")
def cli() -> None:
    """Speculative decoding with relaxed acceptance for autoregressive image models."""


@cli.command()
def plugins() -> None:
    """List installed plugins and where they come from."""
    pm = get_plugin_manager()
    for info in pm.plugins:
        status = f"FAILED: {info.error}" if info.error else "ok"
        click.echo(f"{info.name:<16} {info.source:<24} {info.target}  [{status}]")


@cli.command()
def methods() -> None:
    """List methods with their options and defaults."""
    click.echo(f"{AR:<12} plain autoregressive decoding, the baseline (core)")
    for name, spec in sorted(get_plugin_manager().methods().items()):
        click.echo(f"{name:<12} {spec.description}")
        for field in attrs.fields(spec.options):
            click.echo(f"    {name}.{field.name} = {field.default!r}")


def _labels(text: str | None, num_images: int, num_classes: int) -> list[int]:
    if not text:
        return [i % num_classes for i in range(num_images)]
    try:
        labels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecimgError(f"--class-labels takes comma-separated integers, not {text!r}") from None
    bad = [x for x in labels if not 0 <= x < num_classes]
    if bad:
        raise SpecimgError(f"class label {bad[0]} is outside [0, {num_classes})")
    return [labels[i % len(labels)] for i in range(num_images)]


def _models(target: str | None, preset: str, drafter: str | None, tokenizer: str | None, model: str):
    from specimg.models import loading

    if target:
        return loading.from_paths(target, preset, drafter, tokenizer)
    if drafter or tokenizer:
        raise SpecimgError("--drafter and --tokenizer go with --target")
    if model == "tiny-random":
        return loading.tiny_random()
    raise SpecimgError(f"unknown --model {model!r}")


@cli.command()
@click.option("--method", "-m", default="naive", show_default=True, help="'ar' or a method stack such as cascade+lantern")
@click.option("--option", "-o", "options", multiple=True, metavar="METHOD.KEY=VALUE", help="a method option (repeatable)")
@click.option("--delta", type=float, default=None, help="the stack's total-variation budget [default: largest member delta]")
@click.option("--model", default="tiny-random", show_default=True, help="built-in models to use when no --target is given")
@click.option("--target", type=click.Path(dir_okay=False), help="LlamaGen GPT checkpoint")
@click.option("--preset", default="GPT-B", show_default=True, help="shape of the --target checkpoint")
@click.option("--drafter", type=click.Path(dir_okay=False), help="EAGLE drafter weights (safetensors)")
@click.option("--tokenizer", type=click.Path(dir_okay=False), help="LlamaGen VQ tokenizer checkpoint")
@click.option("--class-labels", help="comma-separated class ids, cycled over the images [default: 0, 1, 2, ...]")
@click.option("--num-images", "-n", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="image i uses seed + i")
@click.option("--cfg-scale", type=click.FloatRange(min=1.0), default=4.0, show_default=True)
@click.option("--cfg-interval", type=click.IntRange(min=-1), default=-1, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--tree", "tree_kind", type=click.Choice(["dynamic", "chain", "static"]), default="dynamic", show_default=True)
@click.option("--depth", type=click.IntRange(min=1), default=TreeConfig().depth, show_default=True)
@click.option("--topk", type=click.IntRange(min=1), default=TreeConfig().topk, show_default=True, help="children per expanded node")
@click.option("--total-tokens", type=click.IntRange(min=1), default=TreeConfig().total_tokens, show_default=True, help="tree size budget")
@click.option("--sample-drafts", is_flag=True, help="draw draft children instead of taking the drafter's top-k")
@click.option("--out", type=click.Path(file_okay=False), default="out", show_default=True)
def generate(**kw: Any) -> None:
    """Generate images and write PNGs, a labelled grid and a JSONL manifest."""
    models = _models(kw["target"], kw["preset"], kw["drafter"], kw["tokenizer"], kw["model"])
    sampling = Sampling(kw["temperature"], kw["top_k"], kw["top_p"], kw["cfg_scale"], kw["cfg_interval"])
    tree = TreeConfig(kw["tree_kind"], kw["depth"], kw["topk"], kw["total_tokens"], sample=kw["sample_drafts"])
    engine = Engine(
        models.target, models.drafter, kw["method"], parse_options(kw["options"]), sampling, tree,
        delta=kw["delta"], tokenizer=models.tokenizer,
    )
    labels = _labels(kw["class_labels"], kw["num_images"], models.num_classes)
    _write_run(engine, models, labels, kw["seed"], kw["out"])


def _write_run(engine: Engine, models: Any, labels: list[int], seed: int, out: str) -> None:
    from specimg.images import make_grid, save_png_atomic, to_pil
    from specimg.manifest import Manifest

    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    settings = {
        "model": models.name, "method": engine.method,
        "options": engine.stack.options_dict() if engine.stack else {}, "delta": engine.stack.delta if engine.stack else 0.0,
        "sampling": attrs.asdict(engine.sampling), "tree": attrs.asdict(engine.tree_config), "seed": seed,
    }
    manifest = Manifest(os.path.join(out, "manifest.jsonl"), settings)
    todo = [i for i in range(len(labels)) if i not in manifest.done]
    forwards = tokens = 0
    start = time.perf_counter()
    with tqdm(total=len(todo) * models.target.num_tokens, unit="tok", desc=engine.method, disable=None) as bar:
        for index in todo:
            result = engine.generate([labels[index]], seed=seed + index, progress=bar.update)
            image_stats = result.stats.images[0]
            forwards, tokens = forwards + image_stats.target_forwards, tokens + image_stats.tokens
            if models.tokenizer is not None:
                save_png_atomic(to_pil(_decode(models.tokenizer, result.tokens))[0], os.path.join(out, "images", f"{index:05d}.png"))
            manifest.add(index, {"condition": labels[index], "seed": seed + index, "tokens": result.tokens[0].tolist(), "stats": image_stats.as_dict()})
    wall = time.perf_counter() - start
    if models.tokenizer is not None:
        entries = [manifest.done[i] for i in sorted(manifest.done)]
        codes = torch.tensor([e["tokens"] for e in entries])
        grid = make_grid(_decode(models.tokenizer, codes), nrow=min(8, len(entries)), labels=[f"class {e['condition']}" for e in entries])
        save_png_atomic(grid, os.path.join(out, "grid.png"))
    tau = tokens / max(1, forwards)
    click.echo(f"{engine.method}: tau {tau:.2f} | {forwards} target forwards for {tokens} tokens | {len(todo)} images in {wall:.2f}s -> {out}")


def _decode(tokenizer: Any, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return tokenizer.decode(codes)


if __name__ == "__main__":
    main()
