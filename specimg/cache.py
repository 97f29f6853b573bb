"""The user cache folder: measured tables worth keeping between runs (codebook
neighbours, the machine's cost model).  ``$SPECIMG_CACHE_DIR`` overrides it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECIMG_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specimg")
