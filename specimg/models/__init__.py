"""Targets, drafters and tokenizers: :func:`load_target` loads a target of any supported
family, :func:`load_drafter` a drafter for it (a specimg drafter file or an EAGLE-style folder)."""

import specimg.models.eagle3  # noqa: F401  (registers the EAGLE-3 drafter type)
from specimg.models.loading import load_drafter
from specimg.models.families import load_target

__all__ = ["load_drafter", "load_target"]
