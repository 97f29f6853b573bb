"""docs/hooks.md documents every hook of specimg/hookspecs.py with its exact arguments, and
every document the code and the docs cite is in the repository."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from specimg import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS_MD = ROOT / "docs" / "hooks.md"


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


def _sources() -> list[Path]:
    folders = ("specimg", "plugins", "docs", "tests", "benchmarks", "contrib")
    found = [p for folder in folders for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return [p for p in found if ".egg-info" not in str(p)] + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_cited_document_is_in_the_repository():
    """Citations by a path under docs/ or by an upper-case name such as README.md, not outputs
    such as bench.md."""
    names = {p.name for p in _sources()}
    for path in _sources():
        for cited in re.findall(r"\b(docs/[\w-]+\.md|[A-Z][A-Z_-]+\.md)\b", path.read_text(encoding="utf-8")):
            assert (ROOT / cited).exists() or cited in names, f"{path.relative_to(ROOT)} cites {cited}, which is not in the repository"


def test_every_markdown_link_and_anchor_resolves():
    for path in [p for p in _sources() if p.suffix == ".md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, f"{path.relative_to(ROOT)} links to {target}: no such heading"


def test_the_readme_is_short_and_every_folder_it_or_the_usage_page_writes_is_one_git_ignores():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150
    assert "out/" in (ROOT / ".gitignore").read_text().split()
    for doc in (ROOT / "README.md", ROOT / "docs" / "usage.md"):
        for folder in re.findall(r"--out ([^\s`,;)]+)", doc.read_text(encoding="utf-8")):
            assert folder == "out" or folder.startswith("out/"), f"{doc.relative_to(ROOT)} writes to {folder}, which git does not ignore"


def test_the_readme_s_python_snippet_runs_and_its_first_call_says_it_measures(tmp_path, monkeypatch, capsys):
    from specimg import costs
    from specimg.engine import MEASURING

    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_memory", {})
    [snippet] = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    assert "torch.set_num_threads(" in snippet  # the snippet states the thread count it runs at
    exec(compile(snippet, "README.md", "exec"), {})
    captured = capsys.readouterr()
    assert captured.err.startswith(f"{MEASURING}:") and "StepTimes(" in captured.out
