"""Output files: folders checked before any work, files written atomically.

Every output gets the permissions the user's umask gives a new file, as ``open`` would;
``tempfile.mkstemp`` and safetensors' ``save_file`` would make it private (0600).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specimg.errors import SpecimgError


MADE: list[list[str]] = []
"""The folders :func:`writable_folder` created inside each open
:func:`specimg.runs.folder.unmade_on_failure` block, outermost first."""


def writable_folder(path: str | os.PathLike[str], flag: str = "--out") -> str:
    """Create ``path`` (and its parents) and prove it writable, so that a wrong output
    folder costs one line before the work starts, not a traceback after it."""
    path = os.fspath(path)
    if not path.strip():
        raise SpecimgError(f"{flag} is empty: name a folder")
    try:
        if MADE:
            MADE[-1] += [os.fspath(p) for p in reversed((Path(path), *Path(path).parents)) if not p.exists()]
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except (FileExistsError, NotADirectoryError):
        in_the_way = next((os.fspath(p) for p in (Path(path), *Path(path).parents) if p.exists() and not p.is_dir()), path)
        raise SpecimgError(f"{flag} {path}: {in_the_way} is a file, not a folder; choose another {flag}") from None
    except OSError as err:
        raise SpecimgError(f"{flag} {path} cannot be written to ({err.strerror or err}); choose another {flag}") from None
    return path


@contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = "") -> Iterator[str]:
    """A temporary path next to ``path`` to write, renamed to ``path`` when the block ends
    and removed if it fails: a crash never leaves a cut-off file where a finished one is
    expected.  ``suffix`` keeps the extension that writers read the format from."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{secrets.token_hex(8)}{suffix}")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
