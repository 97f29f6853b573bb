"""Comma-separated flag values (``--methods naive,lantern``, ``--class-labels 3,5``)."""

from __future__ import annotations

from specimg.errors import SpecimgError


def comma_items(text: str, flag: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``; an empty item (``"a,,b"``, ``"a,"``) is refused: it is
    a typo more often than not, and skipping it would run something else than was asked."""
    if not text.strip():
        raise SpecimgError(f"{flag} {text!r} names nothing: give one value or more, separated by commas")
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise SpecimgError(f"{flag} {text!r} has an empty item: separate values with single commas")
    return items
