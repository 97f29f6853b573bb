"""Frozen value objects that configure a run. No tensors live here."""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs
from attrs import validators as v

from specimg.errors import SpecimgError


def _finite(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    """NaN slips through every comparison and infinity through lower bounds: refuse both."""
    if not math.isfinite(value):
        raise SpecimgError(f"{type(instance).__name__}.{attribute.name} must be a finite number, got {value!r}")


MIN_TEMPERATURE = 1e-6
"""The least temperature above 0 (greedy): logits divided by less could overflow float32."""
MAX_CFG_SCALE = 1e6
"""The largest guidance scale: guided logits scaled by more could overflow float32."""


def _temperature(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if 0.0 < value < MIN_TEMPERATURE:
        raise SpecimgError(f"temperature {value!r}: give 0 (greedy) or at least {MIN_TEMPERATURE:g}, below which the logits overflow")


def _cfg_scale(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if value > MAX_CFG_SCALE:
        raise SpecimgError(f"cfg scale {value!r}: give at most {MAX_CFG_SCALE:g}, beyond which the guided logits overflow")


@attrs.frozen
class Sampling:
    """LlamaGen's sampling, applied in its order: CFG, temperature, top-k, top-p.

    temperature 0 is greedy.  cfg_scale 1 turns guidance (and the unconditional row) off;
    cfg_interval >= 0 stops guidance after that many image tokens, as LlamaGen does.
    """

    temperature: float = attrs.field(default=1.0, validator=[_finite, v.ge(0.0), _temperature])
    top_k: int = attrs.field(default=0, validator=v.ge(0))
    top_p: float = attrs.field(default=1.0, validator=[_finite, v.gt(0.0), v.le(1.0)])
    cfg_scale: float = attrs.field(default=1.0, validator=[_finite, v.ge(1.0), _cfg_scale])
    cfg_interval: int = attrs.field(default=-1, validator=v.ge(-1))

    @property
    def cfg(self) -> bool:
        return self.cfg_scale > 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


LLAMAGEN_SAMPLING = Sampling(cfg_scale=4.0)
"""LlamaGen's class-to-image defaults: CFG 4, temperature 1, no top-k or top-p."""

LLAMAGEN_T2I_SAMPLING = Sampling(cfg_scale=7.5, top_k=1000)
"""LlamaGen's text-to-image defaults (``sample_t2i.py``): CFG 7.5, temperature 1, top-k 1000."""

TreeKind = Literal["auto", "dynamic", "chain", "static"]


@attrs.frozen
class TreeConfig:
    """How the drafter's tree is shaped.

    auto (the default when no size is given): an EAGLE-2 dynamic tree whose depth, top-k and size the engine
    chooses to maximise expected tokens per second, from the machine's measured cost
    model and the run's own acceptance statistics (see specimg.planner); ``depth``,
    ``topk`` and ``total_tokens`` are then ignored.
    dynamic: EAGLE-2 (expand the ``topk`` best frontier nodes per depth by cumulative draft
    log-prob, ``topk`` children each, keep the ``total_tokens`` best nodes).
    chain: ``depth`` tokens, the drafter's best (or sampled) each.
    static: the nodes are ``rank_paths``, each a tuple of draft ranks from the root.
    ``sample`` draws children from the drafter (without replacement) instead of taking its
    top-k; with an unrelaxed method this enables recursive rejection sampling.
    ``ar_fallback`` (auto only): once no tree is predicted faster than AR (by the method's
    measured acceptance, from the first step, or by the image's own steps), the image
    finishes with AR steps; off, the planner keeps its best tree (to measure a method's tau).
    """

    kind: TreeKind = attrs.field(default=None, validator=v.optional(v.in_(("auto", "dynamic", "chain", "static"))))
    depth: int = attrs.field(default=None, validator=v.optional(v.ge(1)))
    topk: int = attrs.field(default=None, validator=v.optional(v.ge(1)))
    total_tokens: int = attrs.field(default=None, validator=v.optional(v.ge(1)))
    rank_paths: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=lambda paths: tuple(tuple(p) for p in paths))
    sample: bool = False
    ar_fallback: bool = True

    def __attrs_post_init__(self) -> None:
        """An unset kind is auto, unless a size is given: explicit sizes mean a dynamic tree.
        Rank paths and a static tree go together: one without the other would draft nothing."""
        sized = (self.depth, self.topk, self.total_tokens) != (None, None, None)
        if self.kind is None:
            object.__setattr__(self, "kind", "dynamic" if sized else "auto")
        if (self.kind == "static") != bool(self.rank_paths):
            raise SpecimgError("a static tree needs rank_paths, and rank_paths need kind='static'")
        for name, default in DYNAMIC_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)


DYNAMIC_DEFAULTS = {"depth": 5, "topk": 10, "total_tokens": 60}
"""A dynamic tree's sizes when unset: EAGLE-2's released sampler defaults."""
