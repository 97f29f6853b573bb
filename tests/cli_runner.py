"""The ``specimg`` command in-process, for tests: its exit status as a number."""

from __future__ import annotations

from specimg.cli import main


def run(*args: str) -> int:
    """Run ``specimg ARGS...``; 0 when it returns, else the status it exits with."""
    try:
        main(list(args))
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0
