"""Put a target, a drafter and a tokenizer together, from paths or at random."""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch

from specimg.errors import SpecimgError
from specimg.models import base
from specimg.models.base import Models
from specimg.models.demo import load_demo
from specimg.models.drafter_folder import load_drafter_folder
from specimg.models.eagle import EagleTarget, TreeDrafter, build_drafter, load_drafter_file
from specimg.models.families import BUILT_IN_MODELS, detect_family, load_family_tokenizer, load_target
from specimg.models.llamagen import build_target
from specimg.models.vq import build_tokenizer

TINY_GPT = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=256, num_classes=10, block_size=64)
"""A tiny random LlamaGen for trying the tool: 8x8 tokens, 10 classes."""
TINY_VQ = dict(codebook_size=256, codebook_embed_dim=8, ch=16, encoder_ch_mult=(1, 2, 2), decoder_ch_mult=(1, 2, 2), z_channels=32, num_res_blocks=1, norm_groups=8)
"""A tiny random VQ tokenizer matching TINY_GPT's vocabulary (4x downsampling: 32x32 images)."""


def placed(models: Models, device: torch.device | str, dtype: torch.dtype | None = None) -> Models:
    """The same models on ``device`` (and in ``dtype``, floating weights only)."""
    target, drafter, tokenizer = (base.placed(m, device, dtype) for m in (models.target, models.drafter, models.tokenizer))
    return attrs.evolve(models, target=target, drafter=drafter, tokenizer=tokenizer)


def tiny_random(seed: int = 0) -> Models:
    """Randomly initialised tiny models: fast, deterministic, and meaningless pictures."""
    target = build_target("GPT-B", seed=seed, **TINY_GPT)
    return Models(target, build_drafter(target, seed=seed + 1), build_tokenizer(seed=seed + 2, **TINY_VQ), "tiny-random")


def built_in(name: str) -> Models:
    """The built-in models called ``name`` (:data:`~specimg.models.families.BUILT_IN_MODELS`)."""
    if name == "tiny-random":
        return tiny_random()
    if name in BUILT_IN_MODELS:
        return load_demo(drafter=name.partition("-")[2] or "plain")
    raise SpecimgError(f"unknown model {name!r}; the built-in ones are {', '.join(BUILT_IN_MODELS)}")


def load_drafter(target: EagleTarget, path: str | os.PathLike[str], *, max_tree_nodes: int = 128) -> TreeDrafter:
    """A drafter for ``target`` from ``path``: a specimg drafter file, of the type its header
    records (:func:`~specimg.models.eagle.load_drafter_file`), or an EAGLE-style folder as
    LANTERN releases them (:mod:`specimg.models.drafter_folder`)."""
    if os.path.isdir(path):
        return load_drafter_folder(target, path, max_tree_nodes=max_tree_nodes)
    return load_drafter_file(target, path, max_tree_nodes=max_tree_nodes)


def load_given_target(path: str | os.PathLike[str], preset: str | None, overrides: dict[str, Any]) -> Any:
    """The target at ``path`` (any family) as ``--preset`` and ``--target-config`` shape it;
    a preset given both ways is refused, whether or not the two agree."""
    if preset and "preset" in overrides:
        raise SpecimgError("the preset is given twice, by --preset and by --target-config preset=...: keep one")
    return load_target(path, **overrides, **({"preset": preset} if preset else {}))


def from_paths(
    target: str | os.PathLike[str],
    preset: str | None = None,
    drafter: str | os.PathLike[str] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    target_overrides: dict[str, Any] | None = None,
    tokenizer_overrides: dict[str, Any] | None = None,
) -> Models:
    """Official (or compatible) checkpoints from local paths, the target's family detected
    from its path.  Without a drafter file the drafter is randomly initialised (only ``ar``
    and exactness checks make sense then).  The tokenizer is the family's
    (:func:`~specimg.models.families.load_family_tokenizer`): a Janus target's own VQ
    model, else the ``tokenizer`` file, else none."""
    model = load_given_target(target, preset, target_overrides or {})
    draft = load_drafter(model, drafter) if drafter else build_drafter(model)
    tok = load_family_tokenizer(detect_family(target), model, tokenizer, **(tokenizer_overrides or {}))
    return Models(model, draft, tok, os.fspath(target))
