"""The models a command's options name: ``--model`` (built in) or ``--target`` with its
files and overrides, the sampling their defaults start from, and the run's fingerprint of
them (a resumed run must have loaded the same files)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import torch

from specimg.cli.options import device_from
from specimg.config import LLAMAGEN_SAMPLING, Sampling
from specimg.errors import SpecimgError
from specimg.runs.folder import inputs_fingerprint


def overrides(pairs: tuple[str, ...], flag: str) -> dict[str, Any]:
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


def default_model() -> str:
    from specimg.models.demo import bundle_exists

    return "demo" if bundle_exists() else "tiny-random"


def models_from(kw: dict[str, Any], model: str) -> Any:
    """The models from paths (``--target``), else the built-in ``model``, whose drafter
    ``--drafter FILE`` may replace (one ``train-drafter --target demo`` made, say)."""
    from specimg.models import loading
    from specimg.models.families import BUILT_IN_MODELS

    target, drafter, tokenizer = kw["target"], kw["drafter"], kw["tokenizer"]
    if target:
        return loading.from_paths(
            target, kw["preset"], drafter, tokenizer,
            overrides(kw["target_config"], "--target-config"), overrides(kw["tokenizer_config"], "--tokenizer-config"),
        )
    if tokenizer:
        raise SpecimgError(f"--tokenizer goes with --target: --model {model} brings its own tokenizer")
    for flag, given in (("--preset", kw["preset"]), ("--target-config", kw["target_config"]), ("--tokenizer-config", kw["tokenizer_config"])):
        if given:
            raise SpecimgError(f"{flag} shapes a --target checkpoint; --model {model} is built in and takes none")
    if model not in BUILT_IN_MODELS:
        raise SpecimgError(f"unknown --model {model!r}; choose {', '.join(BUILT_IN_MODELS)}")
    built_in = loading.built_in(model)
    if not drafter:
        return built_in
    return attrs.evolve(built_in, drafter=loading.load_drafter(built_in.target, drafter), name=f"{built_in.name} with drafter {drafter}")


def train_target(spec: str, preset: str | None, config: tuple[str, ...] = ()) -> Any:
    """``--target`` of the training commands: a checkpoint of any family (a LlamaGen file
    shaped by what it says, ``--preset`` and ``--target-config``; a Janus or Lumina-mGPT
    folder), or a built-in model's target (``demo``, ``tiny-random``)."""
    from specimg.models.families import BUILT_IN_MODELS
    from specimg.models.loading import built_in, load_given_target

    given = overrides(config, "--target-config")
    if spec in BUILT_IN_MODELS:
        if given:
            raise SpecimgError(f"--target-config goes with a checkpoint path, not --target {spec}")
        return built_in(spec).target
    return load_given_target(spec, preset, given)


def run_inputs(kw: dict[str, Any], model: str) -> dict[str, Any]:
    """The run's model inputs, fingerprinted for its settings: the files given (the demo:
    its bundle's) by content and every config override (see specimg.runs.folder)."""
    files = {role: kw.get(role) for role in ("target", "drafter", "tokenizer", "text_encoder")}
    if not kw["target"] and model.startswith("demo"):
        from specimg.models.demo import bundle_dir

        files["demo_bundle"] = bundle_dir()
    configs = {
        "target": {**({"preset": kw["preset"]} if kw.get("preset") else {}), **overrides(kw["target_config"], "--target-config")},
        "tokenizer": overrides(kw["tokenizer_config"], "--tokenizer-config"),
    }
    return inputs_fingerprint(model if not kw["target"] else "checkpoint", files, configs)


def base_sampling(model: str, path: str | None, target: Any) -> Sampling:
    """What unset sampling options default to: the demo bundle's measured sampling, else the
    target's own (``default_sampling``: LlamaGen c2i CFG 4, t2i CFG 7.5 and top-k 1000; Janus
    CFG 5; Lumina-mGPT CFG 4 and top-k 2000), else LlamaGen's c2i defaults."""
    if model.startswith("demo") and not path:
        from specimg.models.demo import demo_sampling

        return demo_sampling()
    return getattr(target, "default_sampling", LLAMAGEN_SAMPLING)


def process_state(kw: dict[str, Any]) -> tuple[Any, torch.device, torch.dtype]:
    """accelerate's state (one process, or one per slice of the work under torchrun / accelerate launch), and this
    process's --device (its own GPU when several processes share ``--device cuda``) and --dtype."""
    from accelerate import PartialState

    device, dtype = device_from(kw)
    state = PartialState(cpu=device.type == "cpu")
    return state, state.device if device.type == "cuda" and device.index is None else device, dtype
