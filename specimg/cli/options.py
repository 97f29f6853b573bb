"""Options shared by the ``specimg`` commands (generate, bench, tune, the training commands), as
click decorators, so that a flag means the same thing, with the same default and help, everywhere."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import click
import torch

from specimg.config import DYNAMIC_DEFAULTS, Sampling, TreeConfig
from specimg.errors import SpecimgError
from specimg.cli.prompts import MAX_PROMPT_CHARS
from specimg.compiled import COMPILE

F = TypeVar("F", bound=Callable[..., Any])


class FiniteFloat(click.FloatRange):
    """A float range that refuses inf and nan, which click's FloatRange lets through."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


SEED = click.IntRange(0, 2**32 - 1)
"""Seeds as numpy and torch both take them; sample i's seed ``seed + i`` stays in torch's range."""

IMAGES = click.IntRange(1, 10**6)
"""Images per command: more would only exhaust memory on the per-image lists."""

THREADS = click.IntRange(1, 1024)


class RankPaths(click.ParamType):
    """A static tree's nodes as rank paths: ``"0 1 0.0 0.1"`` is the drafter's two best
    tokens at the root, and the two best under the first of them."""

    name = "RANK-PATHS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[tuple[int, ...], ...]:
        try:
            paths = tuple(tuple(int(rank) for rank in path.split(".")) for path in value.replace(",", " ").split())
        except ValueError:
            self.fail(f"{value!r} is not a list of rank paths such as '0 1 0.0 0.1'.", param, ctx)
        if not paths or any(rank < 0 for path in paths for rank in path):
            self.fail(f"{value!r} names no node, or a negative rank.", param, ctx)
        if len(set(paths)) != len(paths):
            twice = next(path for path in paths if paths.count(path) > 1)
            self.fail(f"{value!r} names node {'.'.join(map(str, twice))} twice.", param, ctx)
        return paths


class PromptIdsParam(click.ParamType):
    """A whole prompt as token ids, ``"1,2,3"`` (commas or spaces between them), for a target
    whose folder has no text tokenizer; the target checks them against its vocabulary."""

    name = "IDS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        words = value.replace(",", " ").split()
        if not words:
            self.fail(f"{value!r} names no token id.", param, ctx)
        if not all(re.fullmatch(r"[0-9]+", word) for word in words):
            self.fail(f"{value[:40]!r} is not a list of token ids such as '1,2,3' (non-negative integers).", param, ctx)
        try:
            return tuple(int(word) for word in words)
        except ValueError:  # more digits than Python converts
            self.fail(f"{value[:40]!r} holds a number too long to be a token id.", param, ctx)


def _apply(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


# options that the commands that decode and those that train share
METHOD_OPTION = click.option("--option", "-o", "options", multiple=True, metavar="METHOD.KEY=VALUE", help="a method option (repeatable)")
PRESET = click.option("--preset", default=None, help="LlamaGen preset of the --target checkpoint (GPT-B ... GPT-7B) [default: what the checkpoint says, else GPT-B]")
TARGET_CONFIG = click.option("--target-config", multiple=True, metavar="KEY=VALUE", help="a loading option: a GPTConfig field for LlamaGen (block_size=576), or dtype, device, attn_implementation (and image_size for Lumina-mGPT) for a Hugging Face folder")


def prompt_options(fn: F) -> F:
    """Prompts for a t2i target and the text encoder that turns them into caption features."""
    return _apply([
        click.option("--prompt", multiple=True, metavar="TEXT", help="a prompt for a t2i target (repeatable; cycled over the images)"),
        click.option("--prompt-ids", multiple=True, type=PromptIdsParam(), help="a whole prompt as token ids, '1,2,3', for a Janus or Lumina-mGPT folder without a text tokenizer: what the target's template and tokenizer make of a text (repeatable; cycled over the images; not with --prompt)"),
        click.option("--prompts", type=click.Path(dir_okay=False), help=f"prompts for a t2i target from a UTF-8 file: .txt, .jsonl, COCO captions_*.json or PartiPrompts.tsv (each at most {MAX_PROMPT_CHARS} characters); a .jsonl line may give a prompt's token ids instead, {{\"ids\": [1, 2, 3]}}"),
        click.option("--prompt-category", help="only the --prompts of this category (PartiPrompts' Category column, a .jsonl's category field; needs --prompts)"),
        click.option("--text-encoder", help="LlamaGen t2i targets only: turns prompts into caption features: a local T5 folder (flan-t5-xl) or a specimg text-encoder file"),
    ])(fn)


def sampling_options(fn: F) -> F:
    """LlamaGen's sampling: CFG, temperature, top-k, top-p."""
    return _apply([
        click.option("--cfg-scale", type=FiniteFloat(min=1.0), default=None, help="classifier-free guidance [default: the demo's measured scale, else the target family's: LlamaGen 4.0 (c2i) or 7.5 (t2i), Janus 5.0, Lumina-mGPT 4.0]"),
        click.option("--cfg-interval", type=click.IntRange(-1, 2**31 - 1), default=-1, show_default=True),
        click.option("--temperature", type=FiniteFloat(min=0.0), default=None, help="[default: the demo's measured value, else 1.0]"),
        click.option("--top-k", type=click.IntRange(min=0), default=None, help="0 = no top-k [default: the demo's measured value, else the target family's: LlamaGen t2i 1000, Lumina-mGPT 2000, else 0]"),
        click.option("--top-p", type=FiniteFloat(min=0.0, max=1.0, min_open=True), default=None, help="[default: the demo's measured value, else 1.0]"),
    ])(fn)


def device_options(fn: F) -> F:
    """Where the models run and in which floating type."""
    return _apply([
        click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto (a GPU when there is one)"),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True, help="the models' floating type (probabilities stay float32)"),
    ])(fn)


def run_options(num_images: int, tree: bool = True) -> Callable[[F], F]:
    """The options of the commands that decode (generate, bench; tune, which values auto
    trees, without the tree's)."""
    sizes = ", ".join(f"{k} {v}" for k, v in DYNAMIC_DEFAULTS.items())
    trees = [  # the draft tree's shape: chosen per step from the machine's cost model (auto) unless a kind or a size is given
        click.option("--tree", "tree_kind", type=click.Choice(["auto", "dynamic", "chain", "static"]), default=None, help="auto: the EAGLE-2 tree with the most expected tokens per second on this machine [default: auto, or dynamic when a size is given]"),
        click.option("--depth", type=click.IntRange(min=1), default=None, help=f"tree depth (dynamic, chain) [default for dynamic: {sizes}]"),
        click.option("--topk", type=click.IntRange(min=1), default=None, help="children per expanded node (dynamic)"),
        click.option("--total-tokens", type=click.IntRange(min=1), default=None, help="tree size budget (dynamic)"),
        click.option("--rank-paths", type=RankPaths(), help="the nodes of --tree static, e.g. '0 1 0.0 0.1' (dot-separated draft ranks from the root)"),
        click.option("--sample-drafts", is_flag=True, help="draw draft children instead of taking the drafter's top-k"),
        click.option("--ar-fallback/--no-ar-fallback", default=True, show_default=True, help="auto trees: AR steps once no tree is predicted faster than AR (by the method's acceptance measured with the cost model, or the image's own steps)"),
    ]
    return _apply([
        # the method stack's options and budget
        METHOD_OPTION,
        click.option("--delta", type=FiniteFloat(0.0, 1.0), default=None, help="the stack's total-variation budget [default: largest member delta]"),
        # the built-in models, or a target / drafter / tokenizer from paths
        click.option("--model", default=None, help="built-in models when no --target is given: demo, demo-cascade (its drafter trained with CASCADE's loss), demo-eagle3 (an EAGLE-3 drafter) or tiny-random [default: demo when its bundle is installed]"),
        click.option("--target", type=click.Path(), help="target checkpoint: a LlamaGen file, or a Hugging Face folder of another family (see `specimg models`)"),
        PRESET,
        TARGET_CONFIG,
        click.option("--drafter", type=click.Path(), help="EAGLE-1 or EAGLE-3 drafter weights (safetensors; the file records its type), or an EAGLE-style drafter folder as LANTERN releases them (config.json + weights), for --target or in place of the --model's own drafter"),
        click.option("--tokenizer", type=click.Path(dir_okay=False), help="the file that decodes the --target's codes: a LlamaGen VQ checkpoint, or Chameleon's vqgan.ckpt for Lumina-mGPT (a Janus folder and each built-in --model bring their own; see `specimg models`)"),
        click.option("--tokenizer-config", multiple=True, metavar="KEY=VALUE", help="override a VQConfig field"),
        # the conditions
        click.option("--class-labels", help="comma-separated class ids, cycled over the images [default: 0, 1, 2, ...]"),
        click.option("--num-images", "-n", type=IMAGES, default=num_images, show_default=True),
        click.option("--seed", type=SEED, default=0, show_default=True, help="image i uses seed + i"),
        prompt_options,
        sampling_options,
        *(trees if tree else []),
        device_options,
        click.option(  # --cuda-graphs, its former name, still works
            "--compile", "--cuda-graphs", "compile", type=click.Choice(list(COMPILE)), default="auto", show_default=True,
            help="compile the step's programs with torch.compile (captured as CUDA graphs on a GPU): auto = on a GPU, for targets "
                 "with fixed-shape steps (LlamaGen); on = on any device (inductor's C++ on a CPU)",
        ),
    ])


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_from(kw: dict[str, Any]) -> tuple[torch.device, torch.dtype]:
    """--device and --dtype (float32 for a command without it), checked against this machine."""
    name = kw["device"].strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SpecimgError(f"--device {kw['device']!r} is not a device; give cpu, cuda, cuda:N or auto") from None
    if device.type not in ("cpu", "cuda"):
        raise SpecimgError(f"--device {kw['device']!r}: specimg runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecimgError(f"--device {kw['device']!r}: this torch build or machine has no CUDA GPU; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SpecimgError(f"--device {kw['device']!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device, DTYPES[kw.get("dtype") or "float32"]


def sampling_from(kw: dict[str, Any], base: Sampling) -> Sampling:
    """The sampling options as given; those left unset keep ``base``'s value (the demo
    bundle's measured sampling, or LlamaGen's defaults for other models)."""
    given = {k: kw[k] for k in ("cfg_scale", "temperature", "top_k", "top_p", "cfg_interval") if kw[k] is not None}
    return attrs.evolve(base, **given)


_UNUSED_SIZES = {"auto": ("depth", "topk", "total_tokens"), "static": ("depth", "topk", "total_tokens"), "chain": ("topk", "total_tokens")}
"""The size options a tree kind has no use for: given, they would be dropped without a word."""


def tree_from(kw: dict[str, Any]) -> TreeConfig:
    if (kw["tree_kind"] == "static") != bool(kw["rank_paths"]):
        raise SpecimgError("--tree static needs --rank-paths, and --rank-paths needs --tree static")
    unused = [f"--{name.replace('_', '-')}" for name in _UNUSED_SIZES.get(kw["tree_kind"], ()) if kw[name] is not None]
    if unused:
        raise SpecimgError(f"--tree {kw['tree_kind']} takes no {' or '.join(unused)}: drop it, or give --tree dynamic")
    return TreeConfig(kw["tree_kind"], kw["depth"], kw["topk"], kw["total_tokens"], kw["rank_paths"] or (), sample=kw["sample_drafts"],
                      ar_fallback=kw["ar_fallback"])


def check_tree_fits(tree: TreeConfig, target: Any, drafter: Any) -> None:
    """Refuse, before the first image, a tree larger than the models' caches (their
    ``max_tree_nodes``): the most nodes the target verifies and the drafter feeds per step,
    by the builders of ``specimg.tree``.  Auto trees keep within both by construction."""
    if tree.kind == "auto":
        return
    if tree.kind == "static":
        parents = {path[:-1] for path in tree.rank_paths if len(path) > 1}
        bounds = [(target, 1 + len(set(tree.rank_paths)), "--rank-paths"), (drafter, len(parents), "--rank-paths")]
    elif tree.kind == "chain":
        bounds = [(target, tree.depth + 1, "--depth"), (drafter, tree.depth - 1, "--depth")]
    else:
        nodes = min(tree.total_tokens, 1 + tree.topk + (tree.depth - 1) * tree.topk**2)
        bounds = [(target, nodes, "--total-tokens, --topk or --depth"), (drafter, (tree.depth - 1) * tree.topk, "--topk or --depth")]
    for (model, count, flags), role in zip(bounds, ("target", "drafter")):
        limit = getattr(model, "max_tree_nodes", None)
        if limit is not None and count > limit:
            raise SpecimgError(f"this tree takes up to {count} nodes per step in the {role}'s cache, which holds {limit}: lower {flags}")
