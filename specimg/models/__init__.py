"""Targets, drafters and tokenizers; :func:`load_target` loads a target of any supported family."""

from specimg.models.families import load_target

__all__ = ["load_target"]
