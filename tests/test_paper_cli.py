"""Paper modes from the command line: they run under top-k sampling (where a released rule's
residual may leave p's support), an option a mode ignores is refused in one line naming
the mode, and tune either tunes a paper mode or says how to."""

from __future__ import annotations

import pytest

from tests.cli_runner import one_line_error, run

TINY = ["--model", "tiny-random", "-n", "1", "--top-k", "3"]
"""Top-k sampling that masks most of the vocabulary: a rejection soon leaves r empty."""


@pytest.mark.parametrize(("method", "tree"), [("lantern", "tree: depth 4, top-k 10, 59 nodes"), ("lantern++", "tree: lantern++'s own")])
def test_a_paper_mode_runs_under_top_k_sampling(tmp_path, capsys, method: str, tree: str):
    assert run("generate", *TINY, "-m", method, "-o", f"{method}.mode=paper", "--out", str(tmp_path / "o")) == 0
    assert tree in capsys.readouterr().out


@pytest.mark.parametrize("options", [
    ["-m", "lantern", "-o", "lantern.mode=paper", "-o", "lantern.budget=candidate"],
    ["-m", "lantern++", "-o", "lantern++.mode=paper", "-o", "lantern++.delta=0.05"],
    ["-m", "sjd+gsd", "-o", "gsd.mode=paper", "-o", "gsd.acceptance=budget"],
])
def test_an_ignored_option_is_refused_in_one_line(tmp_path, capsys, options: list[str]):
    method = options[3].split(".")[0]
    line = one_line_error(capsys, ["generate", *TINY, *options, "--out", str(tmp_path / "o")])
    assert line.startswith(f"specimg: error: {method}.mode=paper does not use {method}.")
    assert not (tmp_path / "o").exists()


def test_tune_names_its_own_way_for_a_paper_tree(tmp_path, capsys):
    line = one_line_error(capsys, ["tune", "--model", "tiny-random", "-n", "1", "-m", "lantern++", "-o", "lantern++.mode=paper", "--out", str(tmp_path / "t")])
    assert line.endswith("tune it with -o lantern++.mode=specimg")
