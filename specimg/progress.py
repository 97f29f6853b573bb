"""Progress bars that also show in logs (CI, nohup, a pipe), not only on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL = 10.0  # seconds between two lines of a bar written to a log


class _LogBar(tqdm):
    """A bar for a stream that is not a terminal: each refresh is a plain line (a carriage
    return would pile up in the log), and a finished bar ends with a line of its final count."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing a finished bar: a log keeps its lines
            return False
        self.fp.write(f"{self if msg is None else msg}\n")
        self.fp.flush()
        return True

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        """The postfix waits for the next timed line: a log gets no line per call."""
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def close(self) -> None:
        """Write the final count of a finished bar; one that an error stopped short writes
        nothing more (the error's message stays the last line, also when the bar is
        collected later)."""
        if not self.disable and self.n != self.last_print_n and (self.total is None or self.n >= self.total):
            self.display()
        self.leave = False  # the final line is written: tqdm has nothing to clear or repeat
        super().close()


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    total: float | None = None,
    desc: str,
    unit: str = "it",
    show: bool = True,
    file: TextIO | None = None,
    **kw: Any,
) -> tqdm:
    """A tqdm bar on ``file`` (default: stderr).  On a terminal, tqdm's own bar; otherwise a
    line "desc: 23% 120/512 [00:10<00:33, 11.9tok/s]" at most every ``LOG_INTERVAL`` seconds
    (``mininterval`` overrides it) and one with the final count, so that runs without a
    terminal show their progress too.  ``show`` False (a process other than the main one):
    silent.  ``kw`` goes to tqdm (``initial``, ...)."""
    file = file or sys.stderr
    if show and not file.isatty():
        interval = kw.pop("mininterval", LOG_INTERVAL)
        return _LogBar(iterable, total=total, desc=desc, unit=unit, file=file, mininterval=interval, delay=interval, ncols=0, **kw)
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, disable=not show, **kw)
