"""The records of a run folder, as every command that writes one keeps them (``generate``,
``bench``): one manifest line per finished sample, written by every process of the run.

Process r appends to its own manifest (``manifest.jsonl`` for the main process,
``manifest-r.jsonl`` for the others) and reads every one, so a run resumes on any number
of processes; the run holds the folder's lock while it works (:func:`claim`).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from specimg.files import writable_folder
from specimg.runs.folder import claim
from specimg.runs.manifest import Manifest

MANIFEST = "manifest.jsonl"
"""The main process's manifest; process r > 0 writes ``manifest-r.jsonl`` beside it."""


def manifest_path(out: str, rank: int) -> str:
    return os.path.join(out, MANIFEST if rank == 0 else f"manifest-{rank}.jsonl")


@contextlib.contextmanager
def open_run(out: str | os.PathLike[str], settings: Mapping[str, Any], state: Any) -> Iterator[RunLog]:
    """Own ``out`` for the block and read what it holds.  ``settings``: what decides the
    samples (a folder holding other settings is refused); ``state``: an
    ``accelerate.PartialState``."""
    out = os.fspath(out)
    if state.is_main_process:
        writable_folder(out)
    state.wait_for_everyone()
    with claim(out, state):
        log = RunLog(out, dict(settings), state.process_index)
        state.wait_for_everyone()  # everyone has read every file before anyone appends
        yield log


class RunLog:
    """The samples a run folder holds, by index, and this process's manifest to add to."""

    def __init__(self, out: str, settings: dict[str, Any], rank: int) -> None:
        self.out, self.settings = out, settings
        own = manifest_path(out, rank)
        self.done: dict[int, dict[str, Any]] = {}
        for path in self._paths() - {own}:
            self.done.update(Manifest(path, settings).done)
        self._own = Manifest(own, settings)
        self.done.update(self._own.done)

    def _paths(self) -> set[str]:
        return set(glob.glob(os.path.join(self.out, "manifest*.jsonl")))

    def add(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        """Write sample ``index``'s record (flushed before this returns); the entry as kept."""
        self._own.add(index, record)
        self.done[index] = self._own.done[index]
        return self.done[index]

    def first_mismatch(self, expected: Sequence[Mapping[str, Any]]) -> tuple[int, str, Any, Any] | None:
        """The first held sample whose record differs from ``expected[index]`` in one of its
        fields, as (index, field, held value, expected value): the folder holds another
        run's conditions."""
        for index in sorted(self.done):
            if index >= len(expected):
                continue
            for field, value in expected[index].items():
                if self.done[index].get(field) != value:
                    return index, field, self.done[index].get(field), value
        return None

    def all_entries(self) -> list[dict[str, Any]]:
        """Every process's records, read again from the files, by index (once every process
        has finished writing)."""
        entries: dict[int, dict[str, Any]] = {}
        for path in sorted(self._paths()):
            entries.update(Manifest(path, self.settings).done)
        return [entries[i] for i in sorted(entries)]
