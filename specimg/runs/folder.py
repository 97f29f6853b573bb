"""Run folders that never mix two runs: owned by one run at a time, and fingerprinted.

A run folder (generate's, bench's, make-drafter-data's) resumes when the same command runs
on it again.  That is only safe if nothing else writes to it meanwhile and if "the same"
covers everything that decides its results: so a run holds an advisory lock on its folder
while it works (:func:`claim`), and its settings carry :func:`inputs_fingerprint`, a content
digest of every model file it loaded and every config override it was given.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from specimg import files
from specimg.cache import cache_dir
from specimg.errors import SpecimgError
from specimg.files import atomic_path

T = TypeVar("T")

LOCK = ".specimg-lock"
"""The lock file in a run folder; it names the run that holds it."""


@contextlib.contextmanager
def claim(folder: str, state: Any = None) -> Iterator[None]:
    """Own ``folder`` for the block: a second run on it, from any process or machine that
    shares the file system's locks, is refused in one line naming the holder.  Under
    torchrun the main process claims it for all, and a refusal stops every process alike.
    The lock file goes when the block ends; the lock dies with its process, so a killed
    run never leaves the folder locked (only its file, which the next run takes over)."""
    fd = on_main(state, lambda: _lock(folder))
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):  # removed while still held: no run can take the old file
                os.unlink(os.path.join(folder, LOCK))
            os.close(fd)


def on_main(state: Any, make: Callable[[], T]) -> T | None:
    """``make()`` on the main process of ``state`` (None: one process), None on the others;
    a SpecimgError it raises is raised on every process alike, so none waits for the main one."""
    result, error = None, None
    if state is None or state.is_main_process:
        try:
            result = make()
        except SpecimgError as err:
            error = str(err)
    if state is not None and state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error is not None:
        raise SpecimgError(error)
    return result


@contextlib.contextmanager
def unmade_on_failure() -> Iterator[None]:
    """Remove again the folders :func:`specimg.files.writable_folder` makes in the block, if
    the block fails before they hold anything but a lock no run holds: a refused run
    creates nothing, and nothing written is lost."""
    files.MADE.append([])
    try:
        yield
    except BaseException:
        for folder in reversed(files.MADE[-1]):
            _remove_unused(folder)
        raise
    finally:
        files.MADE.pop()


def _remove_unused(folder: str) -> None:
    """Remove ``folder`` if it holds nothing, or only a run's lock that this process can take."""
    lock = os.path.join(folder, LOCK)
    with contextlib.suppress(OSError):  # in use or not empty: kept
        if os.listdir(folder) == [LOCK]:
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by no run: none is using the folder
                os.unlink(lock)
            finally:
                os.close(fd)
        os.rmdir(folder)


def _lock(folder: str) -> int:
    path = os.path.join(folder, LOCK)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise SpecimgError(f"{folder} cannot be locked for this run ({err.strerror or err}); choose another --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 1000, 0).decode("utf-8", "replace").strip() or "a run that has not said which"
            os.close(fd)
            raise SpecimgError(f"{folder} is in use by another run ({holder}); wait for it to end or give another --out") from None
        with contextlib.suppress(OSError):  # done once the path still names the file locked
            here, there = os.fstat(fd), os.stat(path)
            if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
                break
        os.close(fd)  # locked a file its run removed as it ended: lock the folder's file now
    command = " ".join(["specimg", *sys.argv[1:]])[:300]
    holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: {command}"
    with contextlib.suppress(OSError):  # a full disk: the lock holds all the same, it only names nobody
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode("utf-8", "replace"), 0)
    return fd


def inputs_fingerprint(model: str, files: Mapping[str, str | None], configs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What decides a run's results besides its sampling, method and tree: the model's
    name, a content digest of each model file or folder given (by role: target, drafter,
    tokenizer, text encoder) and each role's config overrides."""
    return {
        "model": model,
        "files": {role: file_digest(path) for role, path in sorted(files.items()) if path},
        "configs": {role: dict(sorted(values.items())) for role, values in sorted(configs.items()) if values},
    }


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes, or of a folder's files (names and digests, sorted), kept
    in the cache by path, size and modification time, so a large checkpoint is read once."""
    if os.path.isdir(path):
        entries = []
        for root, dirs, names in os.walk(path):
            dirs.sort()
            entries += [os.path.relpath(os.path.join(root, n), path) for n in sorted(names)]
        lines = "".join(f"{name}\t{file_digest(os.path.join(path, name))}\n" for name in entries)
        return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()
    try:
        stat = os.stat(path)
    except OSError as err:
        raise SpecimgError(f"{path}: {err.strerror or err}") from None
    key = os.path.abspath(path)
    known = _digests()
    entry = known.get(key)
    if isinstance(entry, list) and len(entry) == 3 and entry[:2] == [stat.st_size, stat.st_mtime_ns] and isinstance(entry[2], str):
        return entry[2]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    known[key] = [stat.st_size, stat.st_mtime_ns, digest.hexdigest()]
    with contextlib.suppress(OSError):  # an unwritable cache only costs reading the file again next time
        with atomic_path(_digests_path(), ".json") as tmp, open(tmp, "w", encoding="utf-8") as fh:
            json.dump(known, fh)
    return digest.hexdigest()


def _digests_path() -> str:
    return os.fspath(cache_dir() / "file-digests.json")


def _digests() -> dict[str, Any]:
    try:
        with open(_digests_path(), encoding="utf-8") as fh:
            known = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return {}
    return known if isinstance(known, dict) else {}
