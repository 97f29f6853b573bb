"""Run folders never lose or mix data: one run owns a folder at a time, a rerun with other
model files or config overrides is refused, and a full disk is one line, never success."""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys

import pytest
import torch
from cli_runner import run

from specimg.errors import SpecimgError
from specimg.runs.log import Manifest
from specimg.models.eagle import build_drafter, save_drafter
from specimg.models.llamagen import build_target
from specimg.models.loading import TINY_GPT
from specimg.runs.folder import claim, file_digest, inputs_fingerprint

GENERATE = ["generate", "--model", "tiny-random", "-m", "ar", "-n", "2"]


def one_line(capsys) -> str:
    """The one error line (a run without --tokenizer notes that first)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "no --tokenizer, so no PNGs" not in line]
    assert len(lines) == 1 and lines[0].startswith("specimg: error: "), lines
    return lines[0]


def manifest_lines(out) -> list[str]:
    return (out / "manifest.jsonl").read_text().splitlines()


@pytest.mark.parametrize("command", [
    GENERATE,
    ["bench", "--model", "tiny-random", "--methods", "ar,naive", "-n", "1", "--no-quality", "--warmup", "0"],
    ["make-drafter-data", "--target", "tiny-random", "-n", "2", "--device", "cpu"],
])
def test_a_folder_in_use_is_refused_naming_its_holder(tmp_path, capsys, command):
    out = tmp_path / "run"
    out.mkdir()
    with claim(str(out)):
        assert run(*command, "--out", str(out)) == 2
    line = one_line(capsys)
    assert f"{out} is in use by another run (pid {os.getpid()} on " in line and "give another --out" in line
    assert os.listdir(out) == []  # the refused run wrote nothing; the holder's lock file went with it
    assert run(*command, "--out", str(out)) == 0, capsys.readouterr().err  # released: the next run proceeds
    assert ".specimg-lock" not in os.listdir(out)  # and its lock file went when it ended


def test_a_run_that_takes_a_lock_file_as_its_holder_removes_it_locks_the_new_one(tmp_path, monkeypatch):
    """The race of removing the lock file: a run opens the file, the holder ends and
    removes it, the run locks the removed file.  It must notice and lock the folder's file,
    or two runs would each hold a lock on a different file."""
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    (out / ".specimg-lock").write_text("the holder")
    flock, calls = fcntl.flock, []

    def holder_ends_first(fd, how):
        if not calls:
            os.unlink(out / ".specimg-lock")  # the holder ends between this run's open and its lock
        calls.append(fd)
        return flock(fd, how)

    monkeypatch.setattr(fcntl, "flock", holder_ends_first)
    with claim(str(out)):
        assert len(calls) == 2  # the removed file's lock was dropped, the new file's taken
        assert (out / ".specimg-lock").exists()
        monkeypatch.setattr(fcntl, "flock", flock)
        with pytest.raises(SpecimgError, match="in use by another run"):
            with claim(str(out)):
                pass
    assert not (out / ".specimg-lock").exists()


def test_a_killed_run_leaves_the_folder_free(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; from specimg.runs.folder import claim\nwith claim({str(out)!r}):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SpecimgError, match=f"in use by another run \\(pid {holder.pid} on .* since .*: specimg\\)"):
            with claim(str(out)):
                pass
    finally:
        holder.kill()
        holder.wait()
    with claim(str(out)):  # the lock died with its process
        pass


def test_a_rerun_with_another_drafter_or_config_is_refused(tmp_path, capsys):
    target = build_target("GPT-B", seed=3, **TINY_GPT)
    target_path = tmp_path / "c2i.pt"
    torch.save({"model": target.state_dict(), "args": argparse.Namespace(gpt_model="GPT-B")}, target_path)
    drafters = []
    for seed in (1, 2):
        drafters.append(tmp_path / f"drafter-{seed}.safetensors")
        save_drafter(build_drafter(target, seed=seed), drafters[-1])
    config = [f"--target-config={k}={v}" for k, v in TINY_GPT.items()]
    base = ["generate", "--target", str(target_path), *config, "-m", "naive", "-n", "2", "--out", str(tmp_path / "out")]
    assert run(*base, "--drafter", str(drafters[0])) == 0, capsys.readouterr().err
    capsys.readouterr()
    lines = manifest_lines(tmp_path / "out")
    assert run(*base, "--drafter", str(drafters[1]), "-n", "3") == 2
    assert "holds a run with other settings (inputs.files.drafter:" in one_line(capsys)
    assert run(*base, "--drafter", str(drafters[0]), "--target-config", "max_tree_nodes=64", "-n", "3") == 2
    assert "holds a run with other settings (inputs.configs.target.max_tree_nodes: null there, 64 here)" in one_line(capsys)
    assert manifest_lines(tmp_path / "out") == lines  # untouched
    assert run(*base, "--drafter", str(drafters[0]), "-n", "3") == 0  # the same inputs resume
    assert len(manifest_lines(tmp_path / "out")) == 3


def test_digests_follow_content_and_are_cached_by_size_and_time(tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(b"x" * 1000)
    first = file_digest(str(a))
    assert first == file_digest(str(a))
    a.write_bytes(b"y" * 1001)
    assert file_digest(str(a)) != first
    from specimg.runs import folder as runs_folder

    digests = runs_folder._digests_path()
    with open(digests) as fh:
        known = json.load(fh)
    known[str(a)] = known[str(a)][:2]  # an entry cut short: the file is hashed again
    with open(digests, "w") as fh:
        json.dump(known, fh)
    assert file_digest(str(a)) == file_digest(str(a)) != first
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "w.bin").write_bytes(b"1")
    before = file_digest(str(folder))
    (folder / "sub" / "w.bin").write_bytes(b"22")
    assert file_digest(str(folder)) != before
    print_ = inputs_fingerprint("checkpoint", {"target": str(a), "drafter": None}, {"target": {"b": 1, "a": 2}, "tokenizer": {}})
    assert print_ == {"model": "checkpoint", "files": {"target": file_digest(str(a))}, "configs": {"target": {"a": 2, "b": 1}}}


def test_a_manifest_line_that_cannot_be_written_whole_fails_the_run(tmp_path, monkeypatch):
    manifest = Manifest(tmp_path / "manifest.jsonl", {"k": 1})
    manifest.add(0, {"tokens": [1, 2]})
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))  # the disk fills mid-line
    with pytest.raises(SpecimgError, match=r"the line of sample 1 could not be written \(only \d+ of \d+ bytes written\); free space"):
        manifest.add(1, {"tokens": [3, 4]})
    monkeypatch.setattr(os, "write", real_write)
    resumed = Manifest(tmp_path / "manifest.jsonl", {"k": 1})  # the cut line is dropped, its sample redone
    assert sorted(resumed.done) == [0]
    resumed.add(1, {"tokens": [3, 4]})
    assert [json.loads(line)["index"] for line in manifest_lines(tmp_path)] == [0, 1]


def test_a_full_disk_is_one_line_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    from specimg.runs import images

    out = tmp_path / "out"
    assert run(*GENERATE, "--out", str(out)) == 0
    capsys.readouterr()

    def full(img, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(images, "save_png_atomic", full)
    assert run(*GENERATE[:-1], "4", "--out", str(out)) == 2
    line = one_line(capsys)
    assert line.startswith("specimg: error: ") and "No space left on device; free space and run the same command again" in line
    monkeypatch.undo()
    assert run(*GENERATE[:-1], "4", "--out", str(out)) == 0
    assert len(manifest_lines(out)) == 4 and len(os.listdir(out / "images")) == 4



def test_a_path_in_the_way_is_one_line_and_the_rerun_resumes(tmp_path, capsys):
    """A folder where the grid goes, a file where the images go: one line naming the path
    (not a temporary file's), and every image already written is kept."""
    out = tmp_path / "out"
    (out / "grid.png").mkdir(parents=True)
    assert run(*GENERATE, "--out", str(out)) == 2
    progress, error = capsys.readouterr().err.splitlines()  # the images' bar, then the one error
    assert error == f"specimg: error: {out / 'grid.png'}: Is a directory; clear the way and run the same command again: it resumes"
    assert len(manifest_lines(out)) == 2
    (out / "grid.png").rmdir()
    assert run(*GENERATE[:-1], "3", "--out", str(out)) == 0 and (out / "grid.png").is_file() and len(manifest_lines(out)) == 3
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "images").write_text("")
    assert run(*GENERATE, "--out", str(blocked)) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == f"specimg: error: {blocked / 'images'}: File exists; clear the way and run the same command again: it resumes"


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"), MemoryError()])
def test_running_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch, error):
    from specimg.engine import Engine

    def exhausted(*args, **kwargs):
        raise error

    monkeypatch.setattr(Engine, "generate", exhausted)
    assert run(*GENERATE, "--out", str(tmp_path / "out")) == 2
    assert one_line(capsys).startswith("specimg: error: out of memory; lower --batch-size")
