"""Which model family a path holds, and loading a target of any family from it.

A file (``.pt``, ``.pth``, ``.bin``, ``.safetensors``) is a LlamaGen checkpoint; a folder
is a Hugging Face model whose ``config.json`` ``model_type`` names the family: ``janus``
(Janus-Pro), ``chameleon`` (Lumina-mGPT) or ``llama`` (LlamaGen t2i as LANTERN converts
it).  Each family's adapter lives in its own module of ``specimg.models``, imported only
when a path of that family is loaded, so a family whose module is absent is reported as
unsupported rather than breaking the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from typing import Any

import attrs

from specimg.errors import SpecimgError

_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


@attrs.frozen
class Family:
    """A model family: how to point at it and which module adapts it."""

    name: str
    title: str
    source: str
    """What ``--target`` takes for it."""
    module: str
    loader: str
    model_type: str | None = None
    """The Hugging Face ``config.json`` model_type of its folders (None: a checkpoint file)."""
    tokenizer: str = ""
    """What decodes its codes: ``module:function`` loading the ``--tokenizer`` file, or ""
    when the target brings its own (``target.vq_tokenizer()``)."""
    tokenizer_source: str = ""
    """What ``--tokenizer`` takes for it."""

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


FAMILIES = {f.name: f for f in (
    Family("llamagen", "LlamaGen GPT, class- (c2i) or text-conditional (t2i)", "a checkpoint file (.pt or .safetensors)", "specimg.models.llamagen", "load_target",
           tokenizer="specimg.models.vq:load_tokenizer", tokenizer_source="LlamaGen's VQ file (vq_ds16_c2i.pt, vq_ds16_t2i.pt; shape read from the file)"),
    Family("janus", "Janus-Pro (transformers' JanusForConditionalGeneration)", 'a Hugging Face folder, config.json model_type "janus"', "specimg.models.janus", "load_janus_target", "janus",
           tokenizer_source="none: the folder's own VQ model decodes"),
    Family("lumina", "Lumina-mGPT (transformers' Chameleon)", 'a Hugging Face folder, config.json model_type "chameleon"', "specimg.models.lumina", "load_lumina_target", "chameleon",
           tokenizer="specimg.models.chameleon_vq:load_chameleon_vq_decoder", tokenizer_source="Chameleon's VQGAN checkpoint (tokenizer/vqgan.ckpt)"),
    Family("lantern", "LlamaGen t2i in Hugging Face Llama names (LANTERN's LlamaGen-T2I)", 'a Hugging Face folder, config.json model_type "llama" with input_type "t2i"',
           "specimg.models.lantern", "load_lantern_target", "llama",
           tokenizer="specimg.models.vq:load_tokenizer", tokenizer_source="LlamaGen's VQ file (vq_ds16_t2i.pt)"),
)}


BUILT_IN_MODELS = {
    "demo": "the embedded demo: a 12-layer class-conditional LlamaGen (10 digit classes, 16x16 tokens, 64x64 px), its VQ tokenizer and an EAGLE-1 drafter",
    "demo-cascade": "the demo with an EAGLE-1 drafter trained with CASCADE's loss",
    "demo-eagle3": "the demo with an EAGLE-3 drafter",
    "tiny-random": "random tiny LlamaGen, VQ tokenizer and EAGLE-1 drafter (10 classes, 8x8 tokens, 32x32 px): quick checks, meaningless pictures",
}
"""What ``--model`` takes when no ``--target`` is given (``specimg.models.demo``, ``loading.tiny_random``)."""


def detect_family(path: str | os.PathLike[str]) -> Family:
    """The family of the model at ``path`` (a SpecimgError when it is none of them)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(_CHECKPOINT_SUFFIXES):
            raise SpecimgError(f"{path}: not a checkpoint file ({', '.join(_CHECKPOINT_SUFFIXES)}) nor a Hugging Face folder")
        return FAMILIES["llamagen"]
    if not os.path.isdir(path):
        raise SpecimgError(f"checkpoint not found: {path}")
    model_type = read_config(path).get("model_type")
    for family in FAMILIES.values():
        if family.model_type is not None and family.model_type == model_type:
            return family
    known = ", ".join(repr(f.model_type) for f in FAMILIES.values() if f.model_type)
    raise SpecimgError(f"{os.path.join(path, 'config.json')}: model_type {model_type!r} is no supported family ({known})")


def read_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """A Hugging Face folder's ``config.json``: a JSON object in UTF-8, as transformers writes
    it; anything else is a SpecimgError saying which."""
    path = os.path.join(os.fspath(folder), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        raise SpecimgError(f"{folder} is no Hugging Face model folder (no config.json)") from None
    except OSError as err:
        raise SpecimgError(f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise SpecimgError(f"{path}: byte {err.start} is not UTF-8 (a config.json is UTF-8 JSON)") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, or nesting or a number past what Python reads
        raise SpecimgError(f"{path} is not JSON specimg can read: {err}") from None
    if not isinstance(config, dict):
        raise SpecimgError(f"{path} holds no JSON object")
    return config


def load_target(path: str | os.PathLike[str], **overrides: Any) -> Any:
    """A target of whichever family ``path`` holds, shaped by ``overrides`` (for LlamaGen:
    ``preset`` and GPTConfig fields; a checkpoint that describes itself needs none)."""
    family = detect_family(path)
    try:
        module = importlib.import_module(family.module)
    except ModuleNotFoundError as err:
        if err.name != family.module:
            raise
        raise SpecimgError(f"{path}: {family.title} targets are not supported yet (this specimg has no {family.module})") from None
    return getattr(module, family.loader)(path, **overrides)


def load_family_tokenizer(family: Family, target: Any, path: str | os.PathLike[str] | None, **overrides: Any) -> Any:
    """The tokenizer that decodes ``target``'s codes: its own when it brings one (Janus),
    else the family's loader on ``path``; None without a path (tokens, but no images)."""
    if not family.tokenizer:
        if path or overrides:
            raise SpecimgError(f"{family.title} targets decode with their own VQ model: drop --tokenizer and --tokenizer-config")
        return target.vq_tokenizer()
    if path is None:
        return None
    module, _, loader = family.tokenizer.partition(":")
    return getattr(importlib.import_module(module), loader)(path, **overrides)


def catalogue(demo_installed: bool = True) -> list[str]:
    """``specimg models``: the built-in models (whether the demo bundle is installed), then
    every family, its presets and how to point at it."""
    from specimg.models.llamagen import PRESETS
    from specimg.models.vq import VQ_PRESETS

    lines = ["built-in models: --model NAME, no files needed [default: demo, or tiny-random without the demo bundle]",
             "    --drafter FILE replaces the model's drafter (train-drafter --target demo or tiny-random makes one); no --tokenizer: each brings its own"]
    missing = "" if demo_installed else "  [no demo bundle installed: `specimg train-demo` makes one]"
    for name, description in BUILT_IN_MODELS.items():
        lines.append(f"    {name:<13} {description}{missing if name.startswith('demo') else ''}")
    for family in FAMILIES.values():
        status = "" if family.installed else f"  [not supported yet: needs {family.module}]"
        lines.append(f"{family.name:<10} {family.title}{status}")
        lines.append(f"{'':<10} --target {family.source}")
        lines.append(f"{'':<10} --tokenizer {family.tokenizer_source}")
        if family.name == "lantern":
            lines.append(f"{'':<10} --prompt / --prompts with --text-encoder (a local flan-t5-xl folder); --drafter a LANTERN drafter folder")
        elif family.model_type:
            lines.append(f"{'':<10} --prompt / --prompts, tokenized by the folder's own tokenizer (no --text-encoder); without one, --prompt-ids")
        if family.name == "lumina":
            lines.append(f"{'':<10} --target-config image_size=768 (the default; a multiple of 32 with a size token)")
        if family.name == "llamagen":
            for name, p in PRESETS.items():
                lines.append(f"{'':<10} {name:<9} {p['n_layer']} layers, {p['n_head']} heads, width {p['dim']}")
            lines.append(f"{'':<10} c2i: --class-labels; t2i: --prompt / --prompts with --text-encoder (a local flan-t5-xl folder)")
            lines.append(f"{'':<10} a file with training args needs no --preset; otherwise --preset NAME, --target-config block_size=576 for 384px")
    lines.append(f"{'vq':<10} LlamaGen VQ tokenizer, for LlamaGen targets: --tokenizer FILE (shape read from the file)")
    for name, config in VQ_PRESETS.items():
        lines.append(f"{'':<10} {name:<9} codebook {config.codebook_size} x {config.codebook_embed_dim}, downsampling {config.downsample_factor}")
    return lines
