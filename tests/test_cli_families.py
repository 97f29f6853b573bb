"""Every target family from the command line: tiny random Janus and Lumina-mGPT folders
generate from prompts with ar, naive and cascade+lantern, write PNGs and record the
prompts; greedy naive gives AR's tokens; each family's own sampling is the default; and
an EAGLE drafter is made, trained and used from prompts."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from cli_runner import run  # noqa: E402
from PIL import Image  # noqa: E402

from specimg.models.chameleon_vq import ChameleonVQConfig, ChameleonVQDecoder  # noqa: E402
from specimg.testing.tiny_hf import LUMINA_CODES, save_tiny_janus, save_tiny_lumina  # noqa: E402

FAST = ["--total-tokens", "6", "--depth", "3", "--topk", "2"]
PROMPTS = ["a red cat", "a cat"]
VQGAN = dict(n_embed=LUMINA_CODES, embed_dim=8, z_channels=16, ch=32, ch_mult=(1, 1), num_res_blocks=1)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, list[str]]:
    """Each family's --target flags: a Janus folder alone; a Lumina folder at 64 px with a
    tiny VQGAN checkpoint in the released layout."""
    root = tmp_path_factory.mktemp("families")
    save_tiny_janus(root / "janus")
    save_tiny_lumina(root / "lumina")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save({"state_dict": ChameleonVQDecoder(ChameleonVQConfig(**VQGAN)).state_dict()}, root / "vqgan.ckpt")
    vq = [x for k, v in VQGAN.items() for x in ("--tokenizer-config", f"{k}={json.dumps(list(v) if isinstance(v, tuple) else v)}")]
    return {
        "janus": ["--target", str(root / "janus")],
        "lumina": ["--target", str(root / "lumina"), "--target-config", "image_size=64", "--tokenizer", str(root / "vqgan.ckpt"), *vq],
    }


def manifest(out) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ["janus", "lumina"])
@pytest.mark.parametrize("method", ["ar", "naive", "cascade+lantern"])
def test_generate_from_prompts_writes_pngs_and_records_the_prompts(tmp_path, targets, capsys, family, method) -> None:
    out = tmp_path / "out"
    args = ["generate", *targets[family], "-m", method, *FAST, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "-n", "2", "--out", str(out)]
    assert run(*args) == 0, capsys.readouterr().err
    assert sorted(os.listdir(out / "images")) == ["00000.png", "00001.png"]
    assert Image.open(out / "images" / "00000.png").size == (8, 8)
    assert [e["prompt"] for e in manifest(out)] == PROMPTS
    assert all(len(e["tokens"]) == 16 and "condition" not in e for e in manifest(out))
    assert (out / "grid.png").exists()


@pytest.mark.parametrize("family, sampling", [("janus", "cfg 5, temperature 1, top-k 0"), ("lumina", "cfg 4, temperature 1, top-k 2000")])
def test_greedy_naive_equals_ar_and_the_family_sampling_is_the_default(tmp_path, targets, capsys, family, sampling) -> None:
    tokens = {}
    for method in ("ar", "naive"):
        out = tmp_path / method
        assert run("generate", *targets[family], "-m", method, *FAST, "--temperature", "0", "--prompt", PROMPTS[0], "-n", "1", "--out", str(out)) == 0
        tokens[method] = manifest(out)[0]["tokens"]
        assert manifest(out)[0]["settings"]["sampling"]["cfg_scale"] == float(sampling.split(",")[0].split()[1])
    assert tokens["ar"] == tokens["naive"] and len(set(tokens["ar"])) > 2
    assert run("generate", *targets[family], "-m", "ar", "--prompt", PROMPTS[0], "-n", "1", "--out", str(tmp_path / "s")) == 0
    assert sampling in capsys.readouterr().out


def test_lumina_without_a_tokenizer_keeps_the_tokens_and_says_so(tmp_path, targets, capsys) -> None:
    given = targets["lumina"][:4]  # the folder and its size, no VQGAN
    assert run("generate", *given, "-m", "ar", "--prompt", PROMPTS[0], "-n", "1", "--out", str(tmp_path / "o")) == 0
    assert "no --tokenizer, so no PNGs" in capsys.readouterr().err
    assert not (tmp_path / "o" / "images").exists() and len(manifest(tmp_path / "o")[0]["tokens"]) == 16


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--class-labels", "1"], "text-conditional: give --prompt or --prompts, not --class-labels"),
        ([], "needs --prompts FILE or --prompt TEXT"),
        (["--prompt", "x", "--text-encoder", "enc"], "--text-encoder is for LlamaGen t2i targets"),
        (["--prompt", "x", "--tokenizer", "vq.pt"], "decode with their own VQ model: drop --tokenizer"),
    ],
)
def test_conditions_and_tokenizers_that_do_not_fit_janus(tmp_path, targets, capsys, extra, message) -> None:
    assert run("generate", *targets["janus"], *extra, "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("family", ["janus", "lumina"])
def test_drafter_from_prompts_made_trained_and_used(tmp_path, targets, capsys, family) -> None:
    target = targets[family][:2] + (["--target-config", "image_size=64"] if family == "lumina" else [])
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    data, run_dir = str(tmp_path / "data"), str(tmp_path / "run")
    assert run("make-drafter-data", *target, "--prompts", str(tmp_path / "p.txt"), "-n", "2", "--cfg-scale", "3", "--out", data, "--device", "cpu") == 0, capsys.readouterr().err
    assert run("train-drafter", *target, "--data", data, "--out", run_dir, "--steps", "2", "--batch-size", "2", "--device", "cpu") == 0, capsys.readouterr().err
    drafter = os.path.join(run_dir, "drafter.safetensors")
    out = tmp_path / "out"
    assert run("generate", *targets[family], "--drafter", drafter, "-m", "cascade+lantern", *FAST, "--prompt", PROMPTS[0], "-n", "1", "--out", str(out)) == 0, capsys.readouterr().err
    assert (out / "images" / "00000.png").exists()


@pytest.mark.parametrize("family", ["janus", "lumina"])
def test_bench_runs_on_every_family(tmp_path, targets, capsys, family) -> None:
    """bench places the models itself: Janus's tokenizer is its target's own VQ model."""
    out = tmp_path / "bench"
    args = ["bench", *targets[family], "--methods", "ar,naive", *FAST, "--prompt", PROMPTS[0], "-n", "1", "--warmup", "0", "--no-quality", "--out", str(out)]
    assert run(*args) == 0, capsys.readouterr().err
    assert [v["method"] for v in json.loads((out / "bench.json").read_text())["variants"]] == ["ar", "naive"]
