"""Progress bars show in logs too: plain lines without a terminal, nothing in other processes."""

from __future__ import annotations

import io

import pytest
from cli_runner import run

from specimg.models import loading
from specimg.progress import progress_bar
from specimg.train.data import DataSpec, make_drafter_data


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_a_bar_writes_plain_lines_ending_with_the_count() -> None:
    out = io.StringIO()
    with progress_bar(total=7, desc="gen", unit="tok", file=out) as bar:
        for _ in range(7):
            bar.update(1)
            bar.set_postfix(loss="1.0")  # no line of its own
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 1  # faster than a line's interval: the final one only
    assert lines[0].startswith("gen: 100% 7/7 [") and lines[0].endswith("tok/s, loss=1.0]")

    out = io.StringIO()
    for _ in progress_bar(range(3), desc="steps", file=out, mininterval=0):
        pass
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) > 1 and lines[-1].startswith("steps: 100% 3/3 ")

    out = io.StringIO()
    with pytest.raises(OSError), progress_bar(total=7, desc="gen", file=out) as bar:
        bar.update(3)
        raise OSError("disk full")
    assert out.getvalue() == ""  # stopped short: the error's one line says why


def test_a_hidden_bar_writes_nothing_and_a_terminal_gets_tqdms_own() -> None:
    for out in (io.StringIO(), Terminal()):
        assert list(progress_bar(range(3), desc="x", file=out, show=False)) == [0, 1, 2]
        assert out.getvalue() == ""
    out = Terminal()
    for _ in progress_bar(range(3), desc="x", file=out):
        pass
    assert "\r" in out.getvalue() and "3/3" in out.getvalue()


def test_drafter_data_counts_the_samples_of_this_process(tmp_path, capsys) -> None:
    target, spec = loading.tiny_random().target, DataSpec(num_samples=5, shard_size=2, batch_size=2)
    totals: list[int] = []
    for rank in (0, 1):  # shards 0, 2 (3 samples) and shard 1 (2)
        make_drafter_data(target, tmp_path / "two", spec, process_index=rank, num_processes=2, progress_total=totals.append)
    assert totals == [3, 2]

    assert run("make-drafter-data", "--target", "tiny-random", "-n", "3", "--shard-size", "2", "--device", "cpu", "--out", str(tmp_path / "d")) == 0
    assert "drafter data: 100% 3/3 [" in capsys.readouterr().err
