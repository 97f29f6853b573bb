"""Prompts as token ids (``--prompt-ids``, a .jsonl's ``ids`` field) drive Janus and
Lumina-mGPT folders that have no text tokenizer: the ids of a prompt give the tokens its
text gives a folder with the tokenizer, the manifest records them, a run resumes on them,
and every bad id, mix or target that cannot take them is one line and exit status 2."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from cli_runner import one_line_error, run  # noqa: E402

from specimg.cli.prompts import read_prompts  # noqa: E402
from specimg.errors import SpecimgError  # noqa: E402
from specimg.models.janus import load_janus_target  # noqa: E402
from specimg.models.llamagen import build_target  # noqa: E402
from specimg.models.loading import TINY_GPT  # noqa: E402
from specimg.models.lumina import load_lumina_target  # noqa: E402
from specimg.models.text_encoder import HashTextEncoder  # noqa: E402
from specimg.testing.tiny_hf import save_tiny_janus, save_tiny_lumina  # noqa: E402

PROMPT = "a red cat"
FAST = ["--total-tokens", "6", "--depth", "3", "--topk", "2"]
LOADERS = {"janus": load_janus_target, "lumina": lambda path: load_lumina_target(path, image_size=64)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Each family's tiny folder, and a copy without its tokenizer files ("janus-bare", "lumina-bare")."""
    root = tmp_path_factory.mktemp("prompt-ids")
    found = {}
    for family, save in (("janus", save_tiny_janus), ("lumina", save_tiny_lumina)):
        save(root / family)
        shutil.copytree(root / family, root / f"{family}-bare", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
        found[family], found[f"{family}-bare"] = str(root / family), str(root / f"{family}-bare")
    assert not any(name.startswith("tokenizer") for name in os.listdir(found["lumina-bare"]))
    return found


@pytest.fixture(scope="module")
def prompt_ids(folders) -> dict[str, list[int]]:
    """PROMPT's whole prompt ids, as each family's target with its tokenizer makes them."""
    return {family: LOADERS[family](folders[family]).prompt_ids(PROMPT).tolist() for family in LOADERS}


def target(folders, name: str) -> list[str]:
    extra = ["--target-config", "image_size=64"] if name.startswith("lumina") else []
    return ["--target", folders[name], *extra]


def ids_flag(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def manifest(out) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- ids give the text's tokens


@pytest.mark.parametrize("family", ["janus", "lumina"])
@pytest.mark.parametrize("method", ["ar", "naive"])
def test_a_folder_without_a_tokenizer_takes_ids_and_draws_the_texts_images(tmp_path, folders, prompt_ids, capsys, family, method) -> None:
    text, ids = tmp_path / "text", tmp_path / "ids"
    assert run("generate", *target(folders, family), "-m", method, *FAST, "--prompt", PROMPT, "-n", "2", "--out", str(text)) == 0, capsys.readouterr().err
    args = ["generate", *target(folders, f"{family}-bare"), "-m", method, *FAST, "--prompt-ids", ids_flag(prompt_ids[family]), "-n", "2", "--out", str(ids)]
    assert run(*args) == 0, capsys.readouterr().err
    assert [e["tokens"] for e in manifest(ids)] == [e["tokens"] for e in manifest(text)]
    assert [e["prompt_ids"] for e in manifest(ids)] == [prompt_ids[family]] * 2
    assert all("prompt" not in e and "condition" not in e for e in manifest(ids))
    if family == "janus":  # its own VQ model decodes: PNGs and a grid labelled with the ids
        assert sorted(os.listdir(ids / "images")) == ["00000.png", "00001.png"] and (ids / "grid.png").exists()


def test_ids_resume_and_other_prompts_are_refused(tmp_path, folders, prompt_ids, capsys) -> None:
    out, ids = tmp_path / "o", prompt_ids["janus"]
    given = ["generate", *target(folders, "janus"), "-m", "ar", "-n", "1", "--out", str(out)]
    assert run(*given, "--prompt-ids", ids_flag(ids)) == 0
    capsys.readouterr()
    assert run(*given, "--prompt-ids", ids_flag(ids)) == 0
    assert "already holds these 1 images" in capsys.readouterr().out
    other = [*ids[:2], *ids[3:]]
    line = one_line_error(capsys, [*given, "--prompt-ids", ids_flag(other)])
    assert f"holds image 0 for the prompt {ids}, this run asks for {other}: its prompts differ" in line
    line = one_line_error(capsys, [*given, "--prompt", PROMPT])
    assert f"holds image 0 for the prompt {ids}, this run asks for {PROMPT!r}: its prompts differ" in line


def test_a_jsonl_file_gives_ids_by_category_to_every_command(tmp_path, folders, prompt_ids, capsys) -> None:
    ids = prompt_ids["janus"]
    lines = [{"ids": ids, "category": "Animals"}, {"ids": [ids[0], *ids[-2:]], "category": "Empty"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [(p.ids, p.text, p.meta) for p in read_prompts(path)] == [(tuple(ids), "", {"category": "Animals"}), ((ids[0], *ids[-2:]), "", {"category": "Empty"})]
    bare = target(folders, "janus-bare")
    out = tmp_path / "g"
    assert run("generate", *bare, "-m", "ar", "--prompts", str(path), "--prompt-category", "animals", "-n", "2", "--out", str(out)) == 0, capsys.readouterr().err
    assert [e["prompt_ids"] for e in manifest(out)] == [ids, ids]
    bench = ["bench", *bare, "--methods", "ar", "--prompts", str(path), "-n", "2", "--warmup", "0", "--no-quality", "--out", str(tmp_path / "b")]
    assert run(*bench) == 0, capsys.readouterr().err
    assert [e["condition"] for e in manifest(tmp_path / "b")] == [line["ids"] for line in lines]
    data = tmp_path / "data"
    assert run("make-drafter-data", *bare, "--prompts", str(path), "-n", "2", "--out", str(data), "--device", "cpu") == 0, capsys.readouterr().err
    assert json.loads((data / "meta.json").read_text())["settings"]["prompts"] == [line["ids"] for line in lines]
    assert run("make-drafter-data", *bare, "--prompts", str(path), "-n", "2", "--out", str(data), "--device", "cpu") == 0  # resumes


def test_the_python_api_refuses_ids_outside_the_vocabulary(folders) -> None:
    lumina = LOADERS["lumina"](folders["lumina-bare"])
    with pytest.raises(SpecimgError, match=r"prompt id 64 is outside the model's vocabulary \[0, 64\)"):
        lumina.prefill([1, 64, 7], cfg=True)
    with pytest.raises(SpecimgError, match="takes a prompt text or prompt ids"):
        lumina.prompt_ids(3)
    assert lumina.prompt_ids(torch.tensor([1, 30, 7])).tolist() == [1, 30, 7]


# ----------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.parametrize(
    "name, extra, message",
    [
        ("lumina-bare", ["--prompt-ids", "1,x"], "Invalid value for '--prompt-ids': '1,x' is not a list of token ids such as '1,2,3'"),
        ("lumina-bare", ["--prompt-ids", "1,-2"], "Invalid value for '--prompt-ids': '1,-2' is not a list of token ids"),
        ("lumina-bare", ["--prompt-ids", "1.5"], "Invalid value for '--prompt-ids': '1.5' is not a list of token ids"),
        ("lumina-bare", ["--prompt-ids", ""], "Invalid value for '--prompt-ids': '' names no token id"),
        ("lumina-bare", ["--prompt-ids", " , "], "Invalid value for '--prompt-ids': ' , ' names no token id"),
        ("lumina-bare", ["--prompt-ids", "9" * 5000], "holds a number too long to be a token id"),
        ("lumina-bare", ["--prompt-ids", "1,30,64"], "--prompt-ids '1,30,64': prompt id 64 is outside the model's vocabulary [0, 64)"),
        ("lumina-bare", ["--prompt-ids", "1," + "9" * 30], f"prompt id {'9' * 30} is outside the model's vocabulary [0, 64)"),
        ("lumina-bare", ["--prompt-ids", "1,30", "--prompt", "a cat"], "--prompt and --prompt-ids do not go together"),
        ("lumina-bare", ["--prompt", "a cat"], "has no text tokenizer (tokenizer.json or tokenizer.model) to read --prompt / --prompts with: give each prompt as token ids (--prompt-ids"),
        ("janus-bare", ["--prompt-ids", "1,5,7"], "--prompt-ids '1,5,7': prompt ids must end in begin-of-image (4)"),
        ("janus", ["--prompt-ids", "1,4", "--text-encoder", "enc"], "--text-encoder is for LlamaGen t2i targets"),
    ],
)
def test_bad_prompt_ids_are_one_line(tmp_path, folders, capsys, name, extra, message) -> None:
    line = one_line_error(capsys, ["generate", *target(folders, name), "-n", "1", *extra, "--out", str(tmp_path / "o")])
    assert message in line and len(line) < 400
    assert not (tmp_path / "o" / "manifest.jsonl").exists()


@pytest.mark.parametrize("command", ["generate", "bench", "tune", "make-drafter-data"])
def test_every_command_checks_the_ids_against_the_target(tmp_path, folders, capsys, command) -> None:
    line = one_line_error(capsys, [command, *target(folders, "lumina-bare"), "-n", "1", "--prompt-ids", "1,99", "--out", str(tmp_path / "o")])
    assert line == "specimg: error: --prompt-ids '1,99': prompt id 99 is outside the model's vocabulary [0, 64)"


@pytest.mark.parametrize(
    "lines, message",
    [
        ([{"ids": [1, 30, 99]}], "p.jsonl: the prompt ids '1,30,99': prompt id 99 is outside the model's vocabulary [0, 64)"),
        ([{"ids": [1, 30, 7]}, "a cat"], "a run's prompts are all texts or all token ids: {path} holds both texts and token ids"),
        ([{"ids": []}], "line 1: its 'ids' is an empty array, not an array of token ids"),
        ([{"ids": "1,2"}], "line 1: its 'ids' is a string, not an array of token ids"),
        ([{"ids": [1, None]}], "line 1: its 'ids' holds null, not a token id (a non-negative integer)"),
        ([{"ids": [1, 2.0]}], "line 1: its 'ids' holds 2.0, not a token id"),
        ([{"ids": [True]}], "line 1: its 'ids' holds true, not a token id"),
        ([{"ids": [-1]}], "line 1: its 'ids' holds -1, not a token id"),
        ([{"ids": [1], "prompt": "a cat"}], "line 1 has both 'prompt' and 'ids': give a prompt as text or as token ids, not both"),
    ],
)
def test_bad_ids_files_are_one_line(tmp_path, folders, capsys, lines, message) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    line = one_line_error(capsys, ["generate", *target(folders, "lumina"), "-n", "1", "--prompts", str(path), "--out", str(tmp_path / "o")])
    assert message.format(path=path) in line


def test_texts_and_ids_from_flag_and_file_do_not_mix(tmp_path, folders, capsys) -> None:
    path = tmp_path / "p.txt"
    path.write_text("a cat\n")
    line = one_line_error(capsys, ["generate", *target(folders, "lumina"), "--prompt-ids", "1,30,7", "--prompts", str(path), "--out", str(tmp_path / "o")])
    assert line == f"specimg: error: a run's prompts are all texts or all token ids: {path} gives texts and --prompt-ids token ids"


def test_a_class_conditional_target_refuses_ids(tmp_path, capsys) -> None:
    line = one_line_error(capsys, ["generate", "--model", "tiny-random", "--prompt-ids", "1,2", "--out", str(tmp_path / "o")])
    assert "--prompt / --prompts / --prompt-ids needs a t2i target; this one is class-conditional: give --class-labels" in line


@pytest.fixture
def t2i(tmp_path, tiny_preset) -> list[str]:
    """Flags for a tiny t2i LlamaGen checkpoint and a text encoder that fits it."""
    config = dict(TINY_GPT, model_type="t2i", cls_token_num=4, caption_dim=12, block_size=16)
    args = argparse.Namespace(gpt_model="GPT-T", gpt_type="t2i", vocab_size=256, cls_token_num=4, image_size=16, downsample_size=4)
    torch.save({"model": build_target("GPT-B", seed=0, **config).state_dict(), "args": args}, tmp_path / "t2i.pt")
    HashTextEncoder(dim=12).save(tmp_path / "enc.safetensors")
    return ["--target", str(tmp_path / "t2i.pt"), "--text-encoder", str(tmp_path / "enc.safetensors")]


def test_a_llamagen_t2i_target_refuses_ids_it_cannot_encode(tmp_path, t2i, capsys) -> None:
    line = one_line_error(capsys, ["generate", *t2i, "--prompt-ids", "1,2", "--out", str(tmp_path / "o")])
    assert "--prompt-ids gives token ids, which a LlamaGen t2i target cannot take: it encodes prompt texts with --text-encoder" in line
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"ids": [1, 2]}) + "\n")
    line = one_line_error(capsys, ["make-drafter-data", *t2i, "--prompts", str(path), "-n", "1", "--out", str(tmp_path / "d")])
    assert f"{path} gives token ids, which a LlamaGen t2i target cannot take" in line
