"""What the papers publish, as the command line shows and records it: `specimg methods
--paper`, the drafter trainer's published defaults, and runs that say when a rule keeps no
TVD budget."""

from __future__ import annotations

import json

from cli_runner import run

from specimg.plugins import get_plugin_manager
from specimg.train.drafter import TrainConfig


def test_methods_paper_lists_every_method_and_the_eagle_defaults(capsys):
    assert run("methods", "--paper") == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ")[0].strip("| ") for line in out.splitlines() if line.startswith("| ")]
    assert set(get_plugin_manager().methods()) <= set(rows)
    assert "| gsd | mode | specimg | paper |" in out and "| sjd | mode | specimg | paper |" in out
    assert "| train-drafter eagle3 | ttt_steps, lr, clip_norm | 7, 5e-05, 0.5 |" in out
    assert "depth 5, topk 10, total_tokens 60" in out
    for note in [line for line in out.splitlines() if "no TVD budget" in line]:  # the paper's mode, apart from specimg's default
        assert ". As published (-o " in note and "(no TVD budget" not in note, note
    assert any(line.startswith("lantern++: ") and "As published (-o lantern++.mode=paper" in line and "): no TVD budget" in line for line in out.splitlines())
    assert "| cascade | budget | node | step |" in out and "| sjd | ar_tail | 0 | 18 |" in out
    assert "| lantern++ | tree | auto | mc_sim_7b_63 |" in out
    assert "lam 5 / k 10, lam 10 / k 5, lam 20 / k 5" in out and "depth 4, top-k 10, 59 nodes" in out


def test_methods_marks_a_paper_mode_without_a_budget(capsys):
    assert run("methods") == 0
    out = capsys.readouterr().out
    assert "as published: -o gsd.mode=paper (no TVD budget" in out
    assert "as published: -o sjd.mode=paper -o sjd.ar_tail=18  (" in out  # exact: it keeps the budget of 0


def test_the_trainer_defaults_are_each_drafter_types_published_ones():
    eagle1, eagle3 = TrainConfig(), TrainConfig(drafter_type="eagle3")
    assert (eagle1.lr, eagle1.clip_value, eagle1.clip_norm) == (3e-5, 0.5, None)
    assert (eagle3.ttt_steps, eagle3.lr, eagle3.clip_value, eagle3.clip_norm) == (7, 5e-5, None, 0.5)
    assert TrainConfig(drafter_type="eagle3", lr=1e-3).lr == 1e-3


def test_a_run_records_whether_its_rule_keeps_a_budget(tmp_path):
    for method, budgeted in (("sjd+gsd", False), ("sjd", True)):
        out = tmp_path / method
        assert run("generate", "--model", "tiny-random", "-m", method, "-n", "1", "--out", str(out)) == 0
        entry = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])
        assert entry["settings"]["budgeted"] is budgeted
