"""The specimg command on tiny random models."""

import json
import re
import os

import attrs
import pytest
import torch
from cli_runner import run
from PIL import Image

from specimg.cli import main


def test_generate_writes_images_grid_and_manifest(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("generate", "--model", "tiny-random", "-n", "3", "--class-labels", "2,5", "--out", str(out)) == 0
    assert sorted(os.listdir(out / "images")) == ["00000.png", "00001.png", "00002.png"]
    assert Image.open(out / "grid.png").size[0] > Image.open(out / "images" / "00000.png").size[0]
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert [e["condition"] for e in lines] == [2, 5, 2]
    assert [e["seed"] for e in lines] == [0, 1, 2]
    assert all(len(e["tokens"]) == 64 and e["settings"]["method"] == "naive" for e in lines)
    assert "tau" in capsys.readouterr().out


def test_same_seed_same_images_and_resume_skips_finished_ones(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("generate", "--model", "tiny-random", "-n", "2", "--out", str(a)) == 0
    assert run("generate", "--model", "tiny-random", "-n", "1", "--out", str(b)) == 0
    assert run("generate", "--model", "tiny-random", "-n", "2", "--out", str(b)) == 0
    assert (a / "manifest.jsonl").read_text() != ""
    tokens = lambda d: [json.loads(x)["tokens"] for x in (d / "manifest.jsonl").read_text().splitlines()]
    assert tokens(a) == tokens(b)
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("naive:")]
    assert "1 images" in summary[-1]


def test_the_first_auto_tree_run_reports_measuring_the_machine_apart_from_the_images(tmp_path, capsys, monkeypatch):
    from specimg import costs

    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(costs, "_memory", {})
    for out in ("first", "second"):
        assert run("generate", "--model", "tiny-random", "-n", "1", "--out", str(tmp_path / out)) == 0
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("naive:")]
    assert "s measuring what trees cost on this machine; cached)" in first and "measuring" not in second



def test_an_auto_tree_run_reports_its_own_step_times_and_never_a_paying_ratio_beside_does_not_pay(tmp_path, capsys):
    assert run("generate", "--model", "tiny-random", "-n", "2", "--out", str(tmp_path / "o")) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = next(line for line in lines if line.startswith("naive:"))
    assert re.search(r"2 images in [\d.]+s, [\d.]+ ms a target forward", summary)
    timed = next(line for line in lines if line.startswith("this run: "))
    assert re.search(r"\d+ (drafted|AR) steps, .*[\d.]+ ms each", timed)
    for line in lines:
        if "does not pay" in line:
            assert all(float(x) < 1 for x in re.findall(r"(\d+\.\d+)x", line)), line


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--method", "nope"], "unknown method 'nope'"),
        (["generate", "--method", "+lantern"], "method '+lantern' has an empty member: join method names with '+'"),
        (["generate", "--tree", "chain", "--topk", "3"], "--tree chain takes no --topk: drop it, or give --tree dynamic"),
        (["generate", "--tree", "auto", "--depth", "3", "--total-tokens", "9"], "--tree auto takes no --depth or --total-tokens"),
        (["generate", "--method", " "], "method ' ' has an empty member"),
        (["generate", "-o", "naive.k=1"], "has no option 'k'"),
        (["generate", "--class-labels", "1,x"], "comma-separated integers"),
        (["generate", "--class-labels", "99"], "outside [0, 10)"),
        (["generate", "--target", "missing.pt"], "checkpoint not found"),
        (["generate", "--cfg-scale", "0.5"], "cfg-scale"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, args, message):
    assert run(*args, "--model", "tiny-random", "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_drafter_file_takes_the_place_of_a_built_in_models_own(tmp_path, capsys):
    """The drafter the README's tour trains for --target demo goes with --model demo; here
    an untrained one for tiny-random: the built-in target and tokenizer, the file's drafter."""
    from specimg.models.eagle import build_drafter, save_drafter
    from specimg.models.loading import tiny_random

    drafter, out = tmp_path / "drafter.safetensors", tmp_path / "o"
    save_drafter(build_drafter(tiny_random().target, seed=7), drafter)
    args = ["generate", "--model", "tiny-random", "--drafter", str(drafter), "-m", "naive", "-n", "1", "--tree", "chain", "--depth", "2"]
    assert run(*args, "--out", str(out)) == 0, capsys.readouterr().err
    settings = json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["settings"]
    assert settings["model"] == f"tiny-random with drafter {drafter}"
    assert "drafter" in settings["inputs"]["files"]
    assert (out / "images" / "00000.png").is_file()  # the built-in tokenizer decodes


def test_a_run_with_other_settings_does_not_touch_an_existing_manifest(tmp_path, capsys):
    out = tmp_path / "o"
    assert run("generate", "--model", "tiny-random", "-n", "1", "--out", str(out)) == 0
    before = (out / "manifest.jsonl").read_text()
    assert run("generate", "--model", "tiny-random", "-n", "1", "--seed", "5", "--out", str(out)) == 2
    assert "other settings" in capsys.readouterr().err
    assert (out / "manifest.jsonl").read_text() == before


def _sampling(out) -> dict:
    return json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["settings"]["sampling"]


def test_unset_sampling_options_take_the_models_defaults_and_given_ones_win(tmp_path):
    from specimg.models.demo import bundle_exists, demo_sampling

    assert run("generate", "--model", "tiny-random", "-n", "1", "--out", str(tmp_path / "a")) == 0
    assert _sampling(tmp_path / "a") == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 4.0, "cfg_interval": -1}
    assert run("generate", "--model", "tiny-random", "-n", "1", "--temperature", "0.5", "--top-k", "7", "--out", str(tmp_path / "b")) == 0
    assert _sampling(tmp_path / "b") == {"temperature": 0.5, "top_k": 7, "top_p": 1.0, "cfg_scale": 4.0, "cfg_interval": -1}
    if bundle_exists():  # the demo's measured sampling, one option overridden
        assert run("generate", "--model", "demo", "-m", "ar", "-n", "1", "--top-p", "0.9", "--out", str(tmp_path / "c")) == 0
        measured = attrs.asdict(demo_sampling())
        assert _sampling(tmp_path / "c") == {**measured, "top_p": 0.9}


def test_methods_and_plugins_listings(capsys):
    assert run("methods") == 0
    listing = capsys.readouterr().out
    assert listing.startswith("ar ") and "naive" in listing
    assert run("plugins") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["plugin", "package", "methods", "module", "status"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["lantern_pp"].split() == ["lantern_pp", "specimg", "0.1.0", "lantern++", "specimg_plugins.lantern_pp", "ok"]
    assert {line.index(" specimg_plugins.") for name, line in rows.items() if name in ("naive", "lantern_pp", "cascade")} == {lines[0].index(" module")}


def test_generate_from_checkpoints_in_llamagen_format(tmp_path, capsys):
    import argparse

    import torch

    from specimg.models.llamagen import build_target
    from specimg.models.loading import TINY_GPT, TINY_VQ
    from specimg.models.vq import build_tokenizer

    target_path, vq_path = tmp_path / "c2i.pt", tmp_path / "vq.pt"
    torch.save({"model": build_target("GPT-B", seed=3, **TINY_GPT).state_dict(), "args": argparse.Namespace(gpt_model="GPT-B")}, target_path)
    torch.save({"model": build_tokenizer(seed=4, **TINY_VQ).state_dict()}, vq_path)
    config = [f"--target-config={k}={v}" for k, v in TINY_GPT.items()]
    vq_config = [f"--tokenizer-config={k}={list(v) if isinstance(v, tuple) else v}" for k, v in TINY_VQ.items()]
    for method in ("ar", "naive"):
        out = tmp_path / method
        args = ["generate", "--target", str(target_path), *config, "--tokenizer", str(vq_path), *vq_config, "-m", method, "-n", "2", "--out", str(out)]
        assert run(*args) == 0, capsys.readouterr().err
        assert len(os.listdir(out / "images")) == 2
    assert run("generate", "--target", str(target_path), "--out", str(tmp_path / "x")) == 2
    assert "match no LlamaGen preset; give the head count" in capsys.readouterr().err


def test_device_and_dtype_options(tmp_path, capsys):
    assert run("generate", "--model", "tiny-random", "-n", "1", "--dtype", "bfloat16", "--device", "cpu", "--out", str(tmp_path / "a")) == 0
    settings = json.loads((tmp_path / "a" / "manifest.jsonl").read_text().splitlines()[0])["settings"]
    assert (settings["device"], settings["dtype"]) == ("cpu", "torch.bfloat16")
    for device, message in (("cuda:7", "no CUDA GPU" if not torch.cuda.is_available() else "GPU(s)"), ("tpu", "not a device")):
        assert run("generate", "--model", "tiny-random", "--device", device, "--out", str(tmp_path / "b")) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def _generate_worker(out: str) -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # forked from a process with a single-process state
    assert main(["generate", "--model", "tiny-random", "-n", "5", "--class-labels", "1,2,3", "--out", out]) is None


def test_two_processes_deal_the_images_and_one_resumes(tmp_path, capsys):
    """torchrun / accelerate launch: each process takes every second image and writes its
    own manifest; the images are those of one process, and one process resumes the run."""
    from accelerate import debug_launcher

    one, two = tmp_path / "one", tmp_path / "two"
    assert run("generate", "--model", "tiny-random", "-n", "5", "--class-labels", "1,2,3", "--out", str(one)) == 0
    debug_launcher(_generate_worker, args=(str(two),), num_processes=2)
    entries = lambda d: sorted((json.loads(x) for f in d.glob("manifest*.jsonl") for x in f.read_text().splitlines()), key=lambda e: e["index"])
    assert [(e["index"], e["condition"], e["tokens"]) for e in entries(two)] == [(e["index"], e["condition"], e["tokens"]) for e in entries(one)]
    assert sorted(p.name for p in two.glob("manifest*.jsonl")) == ["manifest-1.jsonl", "manifest.jsonl"]
    assert sorted(os.listdir(two / "images")) == [f"{i:05d}.png" for i in range(5)] and (two / "grid.png").exists()
    capsys.readouterr()
    assert run("generate", "--model", "tiny-random", "-n", "5", "--class-labels", "1,2,3", "--out", str(two)) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_drafter_data_runs_the_target_in_dtype_and_stores_features_as_asked(tmp_path):
    from safetensors.torch import load_file

    for args, stored in ((["--dtype", "bfloat16"], torch.bfloat16), (["--dtype", "bfloat16", "--feature-dtype", "float32"], torch.float32)):
        out = tmp_path / str(stored)
        assert run("make-drafter-data", "--target", "tiny-random", "-n", "2", "--device", "cpu", *args, "--out", str(out)) == 0
        assert load_file(str(out / "shard-00000.safetensors"))["features"].dtype == stored
