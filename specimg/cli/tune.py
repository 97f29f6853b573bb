"""``specimg tune``: what auto trees see on this machine."""

from __future__ import annotations

from typing import Any

import click
import torch

from specimg.cli.conditions import conditions_for
from specimg.cli.loading import base_sampling, default_model, models_from
from specimg.cli.options import THREADS, device_from, run_options, sampling_from
from specimg.config import TreeConfig
from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.files import writable_folder
from specimg.methods import AR, parse_options


@click.command()
@click.option("--method", "-m", default="naive", show_default=True, help="the method stack whose acceptance profile the candidate trees are valued with")
@run_options(num_images=4, tree=False)
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="plan for decoding this many images together (the cost model measured at that size)")
@click.option("--remeasure", is_flag=True, help="measure the cost model again instead of reading the cached one")
@click.option("--threads", type=THREADS, default=None, help="torch CPU threads [default: 1 for the built-in models; torch's choice for --target]")
@click.option("--out", type=click.Path(file_okay=False), default="tune", show_default=True, help="folder for tune.json and tune.png")
def tune(**kw: Any) -> None:
    """Show what auto trees see on this machine: the cost curve, the method's acceptance
    profile (learnt from -n images drafted with a wide tree) and the best candidate trees
    by predicted speedup.  Writes OUT/tune.json and OUT/tune.png."""
    from specimg.eval.tune import tune as run_tune

    if kw["threads"] or not kw["target"]:
        torch.set_num_threads(kw["threads"] or 1)
    device, dtype = device_from(kw)
    model = kw["model"] or default_model()
    models = models_from(kw, model)
    if kw["method"].strip() == AR:
        raise SpecimgError("tune values draft trees: give a method that drafts (naive, cascade+lantern, ...)")
    engine = Engine(
        models.target, models.drafter, kw["method"], parse_options(kw["options"]), sampling_from(kw, base_sampling(model, kw["target"], models.target)),
        TreeConfig(), delta=kw["delta"], tokenizer=models.tokenizer, device=device, dtype=dtype, compile=kw["compile"],
        batch_size=kw["batch_size"],
    )
    if engine.drafter_free:
        raise SpecimgError(f"tune values a drafter's trees; {engine.stack.drafter_free} drafts without one and sizes its own: give a method that drafts (naive, cascade+lantern, ...)")
    if engine.tree_config.kind != "auto":  # a paper mode's released tree
        if engine.hooks.propose.owner is not None:
            owner = engine.hooks.propose.owner
            raise SpecimgError(f"tune sizes auto trees, and {owner} in this mode drafts its release's own tree: tune it with -o {owner}.mode=specimg")
        engine.tree_config = TreeConfig()  # tune values auto trees under the method's rule, whatever tree it runs on by default
    writable_folder(kw["out"])
    run_tune(engine, conditions_for(models.target, kw).values, kw["seed"], kw["out"], click.echo, remeasure=kw["remeasure"])
