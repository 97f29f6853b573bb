"""``specimg methods``: the installed methods, their options, and their papers as published."""

from __future__ import annotations

from typing import Any

import attrs
import click

from specimg.config import DYNAMIC_DEFAULTS
from specimg.methods import AR, Member, MethodSpec, make_options, paper_rows
from specimg.plugins import PluginManager, get_plugin_manager
from specimg.train.drafter import TrainConfig


@click.command()
@click.option("--paper", is_flag=True, help="each method's published settings beside specimg's defaults, and why they differ")
def methods(paper: bool) -> None:
    """List methods with their options and defaults (--paper: beside their papers')."""
    plugins = get_plugin_manager()
    registry = plugins.methods()
    lines = paper_table(registry) if paper else option_list(registry, plugins)
    for line in lines:
        click.echo(line)


def option_list(registry: dict[str, MethodSpec], plugins: PluginManager) -> list[str]:
    lines = [f"{AR:<12} plain autoregressive decoding, the baseline (core)"]
    for name, spec in sorted(registry.items()):
        lines.append(f"{name:<12} {spec.description}")
        lines += [f"    {name}.{field.name} = {field.default!r}" for field in attrs.fields(spec.options)]
        if spec.paper:
            flags, unbudgeted = _published(name, spec)
            lines.append(f"    as published: {flags}{f' ({unbudgeted})' if unbudgeted else ''}  (specimg methods --paper)")
        if not spec.batch and plugins.implementers("build_relaxed_dist", [Member(spec, spec.defaults)]):
            lines.append("    in a batch: relaxes image by image (its MethodSpec does not declare batch=True)")
    return lines


def _published(name: str, spec: MethodSpec) -> tuple[str, str]:
    """The published settings as flags, and what they keep instead of a TVD budget, if they keep none."""
    flags = " ".join(f"-o {name}.{key}={value}" for key, value in (spec.paper or {}).items())
    published = Member(spec, make_options(spec, spec.paper or {}))
    return flags, "" if published.budgeted else "no TVD budget, held to its paper's law, not to delta"


def paper_table(registry: dict[str, MethodSpec]) -> list[str]:
    """Every option whose published value differs from specimg's default, per method, with
    why; then the drafting defaults (trees, drafter training) beside EAGLE's."""
    lines = ["| method | option | specimg default | as published |", "|---|---|---|---|"]
    notes = []
    for name, spec in sorted(registry.items()):
        if spec.paper is None:
            lines.append(f"| {name} | (not a paper's method) | | |")
            continue
        differ = [(option, ours, theirs) for option, ours, theirs in paper_rows(spec) if ours != theirs]
        lines += [f"| {name} | {option} | {_show(ours)} | {_show(theirs)} |" for option, ours, theirs in differ] or [f"| {name} | (none differ) | | |"]
        if spec.departures:
            flags, unbudgeted = _published(name, spec)
            notes.append(f"{name}: {spec.departures}" + (f". As published ({flags}): {unbudgeted}" if unbudgeted else ""))
    eagle1, eagle3 = TrainConfig(drafter_type="eagle1"), TrainConfig(drafter_type="eagle3")
    tree = ", ".join(f"{key} {value}" for key, value in DYNAMIC_DEFAULTS.items())
    lines += [
        f"| EAGLE-2 tree (sizes unset) | depth, topk, total_tokens | {tree} | the same (EAGLE-2's release) |",
        f"| train-drafter eagle3 | ttt_steps, lr, clip_norm | {eagle3.ttt_steps}, {eagle3.lr:g}, {eagle3.clip_norm:g} | the same (EAGLE-3's release) |",
        f"| train-drafter eagle1 | lr, clip_value | {eagle1.lr:g}, {eagle1.clip_value:g} | the same (EAGLE-1's release) |",
        f"| train-drafter eagle1 | noise | {eagle1.noise:g} | uniform, 0.2 * 512 / length on LLM features |",
    ]
    notes.append(
        "train-drafter: EAGLE-1 adds uniform noise to the target's features, sized for LLM features; an image "
        "target's features have another scale, so it is off by default (--noise sets its width). Schedules: EAGLE "
        "decays linearly, here warmup + cosine."
    )
    return lines + [""] + notes


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
