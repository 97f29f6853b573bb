"""No module imports a layer above its own, even inside a function.

From the bottom: the core and ``specimg.models``; ``train``, ``eval`` and ``testing``; the
demo recipe (``specimg.demo``); the command line.  The core never imports a plugin.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specimg"
RANK = {"core": 0, "models": 0, "train": 1, "eval": 1, "testing": 1, "demo": 2, "cli": 3}


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "specimg_plugins":
        return "plugins"
    if parts[0] != "specimg":
        return None
    if len(parts) > 1 and parts[1] in ("models", "train", "eval", "testing", "demo"):
        return parts[1]
    return "cli" if len(parts) > 1 and parts[1] in ("cli", "cliopts") else "core"


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_layer_above_it(path):
    own = layer(".".join(("specimg", *path.relative_to(PACKAGE).with_suffix("").parts)))
    for module in imports(path):
        other = layer(module)
        assert other != "plugins", f"{path.name} imports the plugin {module}"
        if other is not None:
            assert RANK[other] <= RANK[own], f"{path.relative_to(PACKAGE)} ({own}) imports {module} ({other}), a layer above"

