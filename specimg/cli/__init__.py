"""The command line: one module per command (generate, bench, tune, the training commands),
their option groups (:mod:`.options`), how options name models (:mod:`.loading`) and
conditions (:mod:`.conditions`, :mod:`.prompts`); :func:`main` is ``specimg``."""

from specimg.cli.app import cli, main

__all__ = ["cli", "main"]
