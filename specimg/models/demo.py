"""The embedded demo: a small class-conditional LlamaGen (10 digit classes over photo
backgrounds, 16x16 tokens, 64x64 pixels) with its VQ tokenizer and EAGLE drafters,
trained by ``specimg train-demo`` and shipped as package data in ``specimg/demo/bundle``."""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

import attrs

from specimg.config import LLAMAGEN_SAMPLING, Sampling
from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.models.base import Models

DRAFTERS = {"plain": "drafter.safetensors", "cascade": "drafter-cascade.safetensors", "eagle3": "drafter-eagle3.safetensors"}
TARGET_CONFIG_KEY = "specimg.gpt_config"
"""The bundle's target is one safetensors file with its GPTConfig as JSON under this header key."""


def save_target(target: Any, path: str | os.PathLike[str]) -> None:
    from safetensors.torch import save_file

    meta = {TARGET_CONFIG_KEY: json.dumps(attrs.asdict(target.config))}
    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in target.state_dict().items()}, tmp, metadata=meta)


def load_target_file(path: str | os.PathLike[str], max_tree_nodes: int = 128) -> Any:
    from safetensors import safe_open

    from specimg.models.llamagen import GPTConfig, load_target

    with safe_open(os.fspath(path), framework="pt") as f:
        text = (f.metadata() or {}).get(TARGET_CONFIG_KEY)
    if text is None:
        raise SpecimgError(f"{path} has no {TARGET_CONFIG_KEY} header")
    return load_target(path, GPTConfig(**json.loads(text)), max_tree_nodes=max_tree_nodes)


def bundle_dir() -> str:
    """The shipped bundle's folder (it may be absent from a source checkout)."""
    return os.fspath(resources.files("specimg.demo") / "bundle")


def bundle_exists(path: str | os.PathLike[str] | None = None) -> bool:
    root = os.fspath(path) if path is not None else bundle_dir()
    return all(os.path.isfile(os.path.join(root, f)) for f in ("manifest.json", "target.safetensors", "tokenizer.safetensors"))


def load_demo(path: str | os.PathLike[str] | None = None, drafter: str = "plain", max_tree_nodes: int = 128) -> Models:
    """The demo models (named "demo", or "demo-cascade" / "demo-eagle3" with those drafters)
    from ``path`` (default: the shipped bundle).
    ``drafter``: "plain" (EAGLE-1 loss), "cascade" (EAGLE-1 trained with CASCADE's
    reweighting) or "eagle3" (an EAGLE-3 drafter, in bundles made since it joined the recipe)."""
    from specimg.models.eagle import build_drafter, load_drafter_file
    from specimg.models.vq import load_tokenizer

    root = os.fspath(path) if path is not None else bundle_dir()
    if not bundle_exists(root):
        raise SpecimgError(f"no demo bundle in {root}: run `specimg train-demo --out {root}`")
    if drafter not in DRAFTERS:
        raise SpecimgError(f"unknown demo drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    target = load_target_file(os.path.join(root, "target.safetensors"), max_tree_nodes=max_tree_nodes)
    draft_path = os.path.join(root, DRAFTERS[drafter])
    if drafter == "eagle3" and not os.path.isfile(draft_path):
        raise SpecimgError(f"the demo bundle in {root} has no EAGLE-3 drafter ({DRAFTERS[drafter]}): re-create it with `specimg train-demo`")
    draft = load_drafter_file(target, draft_path, max_tree_nodes=max_tree_nodes) if os.path.isfile(draft_path) else build_drafter(target)
    name = "demo" if drafter == "plain" else f"demo-{drafter}"  # what manifests and bench records name
    return Models(target, draft, load_tokenizer(os.path.join(root, "tokenizer.safetensors")), name)


def demo_sampling(path: str | os.PathLike[str] | None = None) -> Sampling:
    """The sampling the quality stage chose and measured (the bundle manifest's ``defaults``:
    cfg_scale, temperature, top_k, top_p); ``specimg generate --model demo`` uses it."""
    root = os.fspath(path) if path is not None else bundle_dir()
    try:
        with open(os.path.join(root, "manifest.json")) as f:
            recorded = json.load(f).get("defaults", {})
    except OSError:
        raise SpecimgError(f"no demo bundle in {root}: run `specimg train-demo --out {root}`") from None
    return attrs.evolve(LLAMAGEN_SAMPLING, **{k: recorded[k] for k in ("cfg_scale", "temperature", "top_k", "top_p") if k in recorded})
