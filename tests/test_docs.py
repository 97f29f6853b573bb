"""docs/hooks.md documents every hook of specimg/hookspecs.py with its exact arguments."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from specimg import hookspecs

HOOKS_MD = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"


def _specs() -> dict[str, list[str]]:
    hooks = [f for _, f in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(f, "specimg_spec")]
    return {f.__name__: list(inspect.signature(f).parameters) for f in hooks}


def _documented() -> dict[str, list[str]]:
    """Every ``def`` in the doc's python blocks: name -> argument names, in order."""
    blocks = re.findall(r"```python\n(.*?)```", HOOKS_MD.read_text(), flags=re.S)
    return {
        node.name: [a.arg for a in node.args.args]
        for block in blocks
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.FunctionDef)
    }


def test_every_hook_is_documented_with_its_exact_arguments():
    specs, documented = _specs(), _documented()
    assert specs, "no hookspecs found"
    assert set(documented) == set(specs), f"documented {sorted(documented)}, declared {sorted(specs)}"
    for name, args in specs.items():
        assert documented[name] == args, f"{name}: docs/hooks.md has {documented[name]}, hookspecs.py {args}"


def test_every_hook_has_its_own_section():
    text = HOOKS_MD.read_text()
    for name in _specs():
        assert f"## `{name}`" in text, f"docs/hooks.md has no section for {name}"
