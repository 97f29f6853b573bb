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


def one_line_error(capsys, args: list[str]) -> str:
    """Run the command; it must fail with status 2 and one line on stderr, which is returned."""
    status = run(*args)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]
