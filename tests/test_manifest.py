"""The run manifest survives a kill in the middle of a line."""

import pytest

from specimg.errors import SpecimgError
from specimg.runs.log import Manifest


def test_a_line_cut_by_a_kill_is_dropped_and_redone(tmp_path):
    path = tmp_path / "manifest.jsonl"
    first = Manifest(path, {"seed": 0})
    first.add(0, {"tokens": [1, 2]})
    with open(path, "a") as fh:
        fh.write('{"index": 1, "tok')  # the kill
    again = Manifest(path, {"seed": 0})
    assert list(again.done) == [0]
    again.add(1, {"tokens": [3]})
    assert sorted(Manifest(path, {"seed": 0}).done) == [0, 1]


def test_other_settings_or_garbage_are_refused(tmp_path):
    path = tmp_path / "manifest.jsonl"
    Manifest(path, {"seed": 0}).add(0, {"tokens": [1]})
    with pytest.raises(SpecimgError, match="other settings"):
        Manifest(path, {"seed": 1})
    path.write_text("not json\n")
    with pytest.raises(SpecimgError, match="line 1 is not JSON"):
        Manifest(path, {"seed": 0})
    for line, why in [("[1, 2]", "is not an object"), ('{"index": "zero", "tokens": []}', "has no image index"),
                      ('{"index": true, "tokens": []}', "has no image index"), ('{"index": 0, "tokens": "abc"}', "has no token list"),
                      ('{"index": 0}', "has no token list")]:
        path.write_text(line + "\n")
        with pytest.raises(SpecimgError, match=f"line 1 {why}"):
            Manifest(path, {"seed": 0})
