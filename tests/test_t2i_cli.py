"""Text-to-image from the command line: a tiny t2i LlamaGen checkpoint that describes
itself, a tiny text encoder, prompts from flags and files, and conditions that do not fit."""

import argparse
import json
import os

import pytest
import torch
from cli_runner import run
from PIL import Image

from specimg.models.text_encoder import HashTextEncoder
from specimg.models.llamagen import build_target
from specimg.models.loading import TINY_GPT, TINY_VQ
from specimg.models.vq import build_tokenizer, save_tokenizer

T2I = dict(TINY_GPT, model_type="t2i", cls_token_num=4, caption_dim=12, block_size=16)
FAST = ["--total-tokens", "8", "--depth", "2", "--topk", "2"]


@pytest.fixture
def files(tmp_path, tiny_preset):
    """A t2i checkpoint with LlamaGen's training args (16 px images, 4x downsampling: a 4x4
    grid), a VQ file with its config in the header and a text-encoder file."""
    args = argparse.Namespace(gpt_model="GPT-T", gpt_type="t2i", vocab_size=256, cls_token_num=4, image_size=16, downsample_size=4)
    torch.save({"model": build_target("GPT-B", seed=0, **T2I).state_dict(), "args": args}, tmp_path / "t2i.pt")
    save_tokenizer(build_tokenizer(seed=1, **TINY_VQ), tmp_path / "vq.safetensors")
    HashTextEncoder(dim=12).save(tmp_path / "enc.safetensors")
    return {"--target": str(tmp_path / "t2i.pt"), "--tokenizer": str(tmp_path / "vq.safetensors"), "--text-encoder": str(tmp_path / "enc.safetensors")}


def flags(files: dict[str, str]) -> list[str]:
    return [x for pair in files.items() for x in pair]


@pytest.mark.parametrize("method", ["ar", "naive", "cascade+lantern"])
def test_generate_from_prompts_writes_pngs_and_records_the_prompts(tmp_path, files, capsys, method):
    out = tmp_path / "out"
    prompts = ["a red cube on a table", "a dog running on wet grass next to a lake at dawn"]
    args = ["generate", *flags(files), "-m", method, *FAST, "--prompt", prompts[0], "--prompt", prompts[1], "-n", "3", "--out", str(out)]
    assert run(*args) == 0, capsys.readouterr().err
    assert sorted(os.listdir(out / "images")) == ["00000.png", "00001.png", "00002.png"]
    assert Image.open(out / "images" / "00000.png").size == (16, 16)
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert [e["prompt"] for e in lines] == [prompts[0], prompts[1], prompts[0]]
    assert all(len(e["tokens"]) == 16 and "condition" not in e for e in lines)
    assert Image.open(out / "grid.png").size[1] > 16 + 2 * 2  # tile, padding and a caption strip


def test_prompt_files_and_greedy_agreement(tmp_path, files, capsys):
    """--prompts reads bench's formats; greedy naive decoding gives AR's tokens, prompt by prompt."""
    (tmp_path / "p.jsonl").write_text('{"caption": "a blue bird"}\n"two cats"\n')
    tokens = {}
    for method in ("ar", "naive"):
        out = tmp_path / method
        args = ["generate", *flags(files), "-m", method, *FAST, "--temperature", "0", "--prompts", str(tmp_path / "p.jsonl"), "-n", "2", "--out", str(out)]
        assert run(*args) == 0, capsys.readouterr().err
        lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
        assert [e["prompt"] for e in lines] == ["a blue bird", "two cats"]
        tokens[method] = [e["tokens"] for e in lines]
    assert tokens["ar"] == tokens["naive"] and tokens["ar"][0] != tokens["ar"][1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--class-labels", "1"], "text-conditional (t2i): give --prompt or --prompts, not --class-labels"),
        ([], "a t2i target needs --prompts FILE or --prompt TEXT"),
        (["--prompt", "x", "--text-encoder", "-"], "no text encoder at -"),
    ],
)
def test_conditions_that_do_not_fit_a_t2i_target(tmp_path, files, capsys, extra, message):
    given = {k: v for k, v in files.items() if k != "--text-encoder"}
    assert run("generate", *flags(given), *extra, "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_prompts_for_a_class_conditional_target_are_refused(tmp_path, capsys):
    assert run("generate", "--model", "tiny-random", "--prompt", "a cat", "--out", str(tmp_path / "o")) == 2
    assert "needs a t2i target; this one is class-conditional" in capsys.readouterr().err


def test_prompts_without_a_text_encoder(tmp_path, files, capsys):
    given = {k: v for k, v in files.items() if k != "--text-encoder"}
    assert run("generate", *flags(given), "--prompt", "a cat", "--out", str(tmp_path / "o")) == 2
    assert "prompts need --text-encoder" in capsys.readouterr().err


def test_shorten_cuts_at_a_word():
    from specimg.cli.conditions import shorten

    assert shorten("a dog running on wet grass next to a lake at dawn", 24) == "a dog running on wet..."
    assert shorten("  short   prompt ") == "short prompt"


def test_unset_sampling_is_llamagens_t2i_sampling(tmp_path, files, capsys):
    assert run("generate", *flags(files), "-m", "ar", "--prompt", "a cat", "-n", "1", "--out", str(tmp_path / "o")) == 0
    assert "cfg 7.5, temperature 1, top-k 1000" in capsys.readouterr().out
