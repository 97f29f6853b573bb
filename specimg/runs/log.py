"""The records of a run folder, as every command that writes one keeps them (``generate``,
``bench``): one JSONL manifest line per finished sample, written by every process of the
run, so that a killed run resumes.

Each line is flushed as soon as its sample is done; a run started again with the same
settings skips what the manifests already hold, and one with other settings is refused
rather than mixing results.  Process r appends to its own manifest (``manifest.jsonl`` for
the main process, ``manifest-r.jsonl`` for the others) and reads every one, so a run
resumes on any number of processes; the run holds the folder's lock while it works
(:func:`claim`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from specimg.errors import SpecimgError
from specimg.files import writable_folder
from specimg.runs.folder import claim

MANIFEST = "manifest.jsonl"
"""The main process's manifest; process r > 0 writes ``manifest-r.jsonl`` beside it."""


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
        own = os.path.join(out, MANIFEST if rank == 0 else f"manifest-{rank}.jsonl")
        self.done: dict[int, dict[str, Any]] = {}
        for path in self._paths() - {own}:
            self.done.update(Manifest(path, settings).done)
        self._own = Manifest(own, settings)
        self.done.update(self._own.done)

    def _paths(self) -> set[str]:
        return set(glob.glob(os.path.join(self.out, "manifest*.jsonl")))

    def add(self, index: int, record: dict[str, Any]) -> None:
        """Write sample ``index``'s record (flushed before this returns)."""
        self._own.add(index, record)
        self.done[index] = self._own.done[index]

    def first_mismatch(self, expected: Sequence[Mapping[str, Any]]) -> tuple[int, str, Any, Any] | None:
        """The first held sample whose record differs from ``expected[index]`` in one of its
        fields, as (index, field, held value, expected value): the folder holds another
        run's conditions."""
        for index in sorted(i for i in self.done if i < len(expected)):
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


class Manifest:
    def __init__(self, path: str | os.PathLike[str], settings: dict[str, Any]):
        self.path = os.fspath(path)
        self.settings = json.loads(json.dumps(settings))  # compare as read back (tuples become lists)
        self.done: dict[int, dict[str, Any]] = {}
        if os.path.exists(self.path):
            self._drop_cut_tail()
            for entry in read_entries(self.path):
                if entry.get("settings") != self.settings:
                    folder = os.path.dirname(self.path) or "."
                    raise SpecimgError(
                        f"{folder} holds a run with other settings ({_difference(entry.get('settings'), self.settings)}); "
                        f"give another --out or remove {folder}"
                    )
                self.done[entry["index"]] = entry

    def _drop_cut_tail(self) -> None:
        """A kill mid-write leaves a last line without its newline: cut it off, so that the
        next append starts a line of its own and that sample is simply redone."""
        with open(self.path, "rb+") as fh:
            data = fh.read()
            if data and not data.endswith(b"\n"):
                fh.truncate(data.rfind(b"\n") + 1)

    def add(self, index: int, record: dict[str, Any]) -> None:
        """Append one line in one write to a file opened for appending: processes that
        share the manifest never interleave their lines.  A line that cannot be written
        whole (a full disk) fails the run; the next run cuts off what part of it was
        written and redoes that sample."""
        entry = {"index": index, **record, "settings": self.settings}
        line = (json.dumps(entry) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes written", self.path)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise SpecimgError(
                f"{self.path}: the line of sample {index} could not be written ({err.strerror or err}); "
                "free space and run the same command again: it resumes"
            ) from None
        self.done[index] = entry


def read_entries(path: str) -> Iterator[dict[str, Any]]:
    """The entries of a manifest file, in file order."""
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                raise SpecimgError(f"{path}: line {number} is not JSON; not a specimg manifest?") from None
            why = _malformed(entry)
            if why:
                raise SpecimgError(f"{path}: line {number} {why}; not a specimg manifest?")
            yield entry


def _malformed(entry: Any) -> str | None:
    """What keeps ``entry`` from being an image's record (its index and tokens), or None."""
    if not isinstance(entry, dict):
        return "is not an object"
    index, tokens = entry.get("index"), entry.get("tokens")
    if type(index) is not int or index < 0:
        return "has no image index (a whole number from 0)"
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return "has no token list"
    return None


def _difference(old: Any, new: dict[str, Any], prefix: str = "") -> str:
    """The first setting that differs, as ``key: old there, new here``."""
    if not isinstance(old, dict):
        return "none recorded there"
    for key in sorted(set(old) | set(new)):
        there, here = old.get(key), new.get(key)
        if there != here:
            if isinstance(there, dict) and isinstance(here, dict):
                return _difference(there, here, f"{prefix}{key}.")
            return f"{prefix}{key}: {json.dumps(there)} there, {json.dumps(here)} here"
    return ""
