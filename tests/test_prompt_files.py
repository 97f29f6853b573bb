"""Prompt files are read as written, and every bad prompt, prompt file or condition flag
that does not apply ends in one line and exit status 2 (issue 25)."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runner import one_line_error, run
import torch

from specimg.errors import SpecimgError
from specimg.cli import prompts
from specimg.cli.conditions import conditions_for
from specimg.cli.prompts import MAX_PROMPT_CHARS, read_prompts
from specimg.models.text_encoder import HashTextEncoder
from specimg.models.llamagen import build_target
from specimg.models.loading import TINY_GPT

HEADER = "Prompt\tCategory\tChallenge\tNote\n"
GIGGLE = '"G I G G L E" painted in thick colorful lettering as graffiti on a faded red brick wall with a splotch of exploding white paint.'
TOO_LONG = "a" * 200_000
NESTED = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def t2i(tmp_path, tiny_preset):
    """Flags for a tiny t2i LlamaGen checkpoint and a text encoder that fits it."""
    config = dict(TINY_GPT, model_type="t2i", cls_token_num=4, caption_dim=12, block_size=16)
    args = argparse.Namespace(gpt_model="GPT-T", gpt_type="t2i", vocab_size=256, cls_token_num=4, image_size=16, downsample_size=4)
    torch.save({"model": build_target("GPT-B", seed=0, **config).state_dict(), "args": args}, tmp_path / "t2i.pt")
    HashTextEncoder(dim=12).save(tmp_path / "enc.safetensors")
    return ["--target", str(tmp_path / "t2i.pt"), "--text-encoder", str(tmp_path / "enc.safetensors")]


def write(path, text: str):
    path.write_bytes(text.encode())
    return path


# ----------------------------------------------------------------------------- read as written


def test_partiprompts_rows_are_read_as_written(tmp_path):
    """No quote processing: a leading quote stays, an unclosed one joins no rows."""
    text = HEADER + f"{GIGGLE}\tIllustrations\tWriting & Symbols\t\n" + '"unclosed\tArts\tBasic\t\r\n' + "A car\tVehicles\tBasic\tn\n"
    got = read_prompts(write(tmp_path / "PartiPrompts.tsv", text))
    assert [p.text for p in got] == [GIGGLE, '"unclosed', "A car"]
    assert [p.meta["category"] for p in got] == ["Illustrations", "Arts", "Vehicles"]


def test_generate_keeps_a_partiprompts_quote_in_the_manifest(tmp_path, t2i, capsys):
    write(tmp_path / "PartiPrompts.tsv", HEADER + f"{GIGGLE}\tIllustrations\tWriting & Symbols\t\n")
    out = tmp_path / "out"
    assert run(*["generate", *t2i, "-m", "ar", "-n", "1", "--prompts", str(tmp_path / "PartiPrompts.tsv"), "--out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "manifest.jsonl").read_text().splitlines()[0])["prompt"] == GIGGLE


@pytest.mark.parametrize(
    "name, text",
    [
        ("PartiPrompts.tsv", HEADER + "a red cube\tArts\tBasic\t\n"),
        ("p.jsonl", '{"caption": "a red cube"}\n'),
        ("captions_val2014.json", json.dumps({"images": [{"id": 1, "file_name": "1.jpg"}], "annotations": [{"image_id": 1, "id": 2, "caption": "a red cube"}]})),
        ("p.txt", "a red cube\n"),
    ],
)
def test_a_byte_order_mark_is_skipped(tmp_path, name, text):
    assert [p.text for p in read_prompts(write(tmp_path / name, "\ufeff" + text))] == ["a red cube"]


# ----------------------------------------------------------------------------- bad files


COCO_CAPTION = {"image_id": 1, "id": 2, "caption": "a cat"}

BAD_FILES = [
    # size limits
    ("PartiPrompts.tsv", HEADER + f"{TOO_LONG}\tArts\tBasic\t\n", f"line 2, column Prompt is 200000 characters long; a prompt or PartiPrompts field takes at most {MAX_PROMPT_CHARS}"),
    ("PartiPrompts.tsv", HEADER + f"a cat\tArts\tBasic\t{TOO_LONG}\n", "line 2, column Note is 200000 characters long"),
    ("p.txt", TOO_LONG, "line 1 is 200000 characters long"),
    ("p.jsonl", json.dumps(TOO_LONG), "line 1 is 200000 characters long"),
    # blank prompts
    ("PartiPrompts.tsv", HEADER + "a cat\tArts\tBasic\t\n \tArts\tBasic\t\n", "line 3, column Prompt is blank"),
    ("PartiPrompts.tsv", HEADER + "a cat\tArts\tBasic\t\tmore\n", "line 2 has 5 tab-separated fields, the header names 4"),
    ("p.txt", "a cat\n  \t\n", "line 2 is blank"),
    ("p.jsonl", '"a cat"\n""\n', "line 2 is blank"),
    ("p.jsonl", '{"caption": "   "}\n', "line 1 is blank"),
    ("captions.json", json.dumps({"annotations": [COCO_CAPTION, dict(COCO_CAPTION, id=3, caption=" ")]}), "annotations[1] (id 3) is blank"),
    # JSON shapes
    ("captions.json", json.dumps({"images": 5, "annotations": [COCO_CAPTION]}), "COCO 'images' must be a list of objects with an integer id"),
    ("captions.json", json.dumps({"images": [{"id": "1"}], "annotations": [COCO_CAPTION]}), "COCO 'images' must be a list"),
    ("captions.json", json.dumps({"images": [{"id": 1, "file_name": 7}], "annotations": [COCO_CAPTION]}), "COCO 'images' must be a list"),
    ("captions.json", json.dumps({"annotations": [5]}), "annotations[0] is not a COCO caption"),
    ("captions.json", json.dumps({"annotations": [dict(COCO_CAPTION, image_id="1")]}), "annotations[0] is not a COCO caption"),
    ("captions.json", json.dumps({"annotations": [dict(COCO_CAPTION, caption=None)]}), "annotations[0] is not a COCO caption"),
    ("captions.json", json.dumps({"annotations": {"a": 1}}), "not a COCO captions file"),
    ("captions.json", NESTED, "nests JSON arrays or objects too deeply"),
    ("p.jsonl", '"a cat"\n' + NESTED + "\n", "line 2 nests JSON arrays or objects too deeply"),
    ("p.jsonl", "5\n", "line 1 is a number, not a string or an object"),
    ("p.jsonl", '{"caption": ["a cat"], "text": "x"}\n', "line 1 has no string field caption / prompt / text: its 'caption' is an array"),
    ("p.jsonl", "1" * 5000 + "\n", "line 1 is not JSON specimg can read: Exceeds the limit"),
    # text no tokenizer can encode
    ("p.jsonl", '"a \\udcff cat"\n', "line 1 holds the lone surrogate '\\udcff' at character 3 (a byte that was not UTF-8, or half of a JSON"),
]


@pytest.mark.parametrize("name, text, message", BAD_FILES)
def test_bad_prompt_files_are_one_line(tmp_path, t2i, capsys, name, text, message):
    line = one_line_error(capsys, ["generate", *t2i, "-n", "1", "--prompts", str(write(tmp_path / name, text)), "--out", str(tmp_path / "o")])
    assert message in line and len(line) < 400
    assert not (tmp_path / "o").exists()


def test_a_prompt_file_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "MAX_PROMPT_FILE_BYTES", 8)
    with pytest.raises(SpecimgError, match="is larger than 0 MiB, the most specimg reads"):
        read_prompts(write(tmp_path / "p.txt", "a cat\na dog\n"))


# ----------------------------------------------------------------------------- --prompt


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "--prompt '' is blank"),
        ("  ", "--prompt '  ' is blank"),
        ("a \udcff cat", "--prompt 'a \\udcff cat' holds the lone surrogate '\\udcff' at character 3 (a byte that was not UTF-8"),
        (TOO_LONG, f"--prompt '{'a' * 40}'... is 200000 characters long"),
    ],
)
def test_bad_prompts_are_one_line(tmp_path, t2i, capsys, prompt, message):
    line = one_line_error(capsys, ["generate", *t2i, "-n", "1", "--prompt", "a dog", "--prompt", prompt, "--out", str(tmp_path / "o")])
    assert message in line and len(line) < 400


# ----------------------------------------------------------------------------- flags that do not apply


@pytest.mark.parametrize("command", ["generate", "make-drafter-data"])
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-category", "Animals"], "--prompt-category picks among the prompts of --prompts FILE"),
        (["--text-encoder", "enc.safetensors"], "--text-encoder is for LlamaGen t2i targets; this one is class-conditional"),
    ],
)
def test_flags_a_class_conditional_target_would_ignore(tmp_path, capsys, command, extra, message):
    target = ["--model", "tiny-random"] if command == "generate" else ["--target", "tiny-random"]
    line = one_line_error(capsys, [command, *target, "-n", "1", *extra, "--out", str(tmp_path / "o")])
    assert message in line


def test_a_prompt_category_needs_a_prompt_file(tmp_path, t2i, capsys):
    line = one_line_error(capsys, ["generate", *t2i, "--prompt", "a cat", "--prompt-category", "Animals", "--out", str(tmp_path / "o")])
    assert "--prompt-category picks among the prompts of --prompts FILE" in line


def test_a_target_without_its_text_tokenizer_names_the_folder_not_prompt_ids():
    folder_without_tokenizer = SimpleNamespace(prompt_ids=lambda condition: None, text_tokenizer=None)
    with pytest.raises(SpecimgError, match=r"this target's folder has no text tokenizer \(tokenizer.json or tokenizer.model\) to read --prompt"):
        conditions_for(folder_without_tokenizer, {"num_images": 1, "prompt": ("a cat",)})


def test_the_docs_state_the_limits():
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text().split())
    assert f"over {MAX_PROMPT_CHARS} characters" in docs and f"over {prompts.MAX_PROMPT_FILE_BYTES >> 30} GiB" in docs
