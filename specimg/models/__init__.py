"""Targets, drafters and tokenizers; :func:`load_target` loads a target of any supported family."""

import specimg.models.eagle3  # noqa: F401  (registers the EAGLE-3 drafter type)
from specimg.models.families import load_target

__all__ = ["load_target"]
