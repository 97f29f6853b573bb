"""Loaders refuse what they cannot load faithfully, each with one line and exit status 2:
a Hugging Face folder whose weights are another model's, missing or extra; weights that are
NaN or inf; a bad --target-config value (before any file is read); damaged files."""

from __future__ import annotations

import json
import os
import shutil

import attrs
import pytest
from cli_runner import one_line_error
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specimg.errors import SpecimgError
from specimg.models.text_encoder import HashTextEncoder, load_text_encoder
from specimg.models.demo import load_target_file, save_target
from specimg.models.eagle import build_drafter, save_drafter
from specimg.models.llamagen import FIELD_RULES, GPTConfig, build_target
from specimg.models.loading import TINY_GPT, TINY_VQ
from specimg.models.vq import build_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")

from specimg.testing.tiny_hf import save_tiny_janus  # noqa: E402

T5_WORDS = ["<pad>", "</s>", "<unk>", "a", "red", "dog"]
T5_SIZES = dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)


# ----------------------------------------------------------------------------- files


def edit_safetensors(path, change) -> None:
    """Rewrite a safetensors file with ``change(tensors)`` applied, keeping its header."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata=meta)


def poison(tensors: dict[str, torch.Tensor], value: float = float("nan")) -> None:
    """Put ``value`` into the first floating tensor (by name)."""
    name = next(k for k in sorted(tensors) if tensors[k].is_floating_point())
    tensors[name].view(-1)[0] = value


@pytest.fixture(scope="module")
def janus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("janus") / "janus"
    save_tiny_janus(folder)
    return folder


def t5_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(T5_WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """A tiny T5 encoder folder, as test_text_encoder builds it."""
    folder = tmp_path_factory.mktemp("t5") / "t5"
    t5_tokenizer().save_pretrained(folder)
    torch.manual_seed(0)
    transformers.T5EncoderModel(transformers.T5Config(vocab_size=len(T5_WORDS), **T5_SIZES)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def t2i(tmp_path_factory):
    """A tiny t2i LlamaGen checkpoint taking the T5 folder's 16-d features."""
    path = tmp_path_factory.mktemp("t2i") / "t2i.pt"
    target = build_target("GPT-B", **{**TINY_GPT, "model_type": "t2i", "cls_token_num": 8, "caption_dim": 16, "block_size": 16})
    torch.save({"model": target.state_dict()}, path)
    return path


TINY_FLAGS = [f"--target-config={k}={v}" for k, v in TINY_GPT.items()]
T2I_FLAGS = [f"--target-config={k}={v}" for k, v in {"dim": 64, "n_layer": 2, "n_head": 4, "multiple_of": 32, "block_size": 16}.items()]


def variant(source, tmp_path, change):
    """A copy of the folder ``source`` with ``change(copy)`` applied."""
    folder = tmp_path / "variant"
    shutil.copytree(source, folder)
    change(folder)
    return folder


def generate(target, tmp_path, *extra: str) -> list[str]:
    return ["generate", "--target", str(target), "-m", "ar", "-n", "1", "--out", str(tmp_path / "out"), *extra]


# ----------------------------------------------------------------------------- 1. the weights a folder holds


def drop_one(folder) -> None:
    edit_safetensors(folder / "model.safetensors", lambda t: t.pop(sorted(t)[0]))


def add_one(folder) -> None:
    edit_safetensors(folder / "model.safetensors", lambda t: t.update({"extra.weight": torch.zeros(2)}))


def test_a_janus_folder_with_another_models_weights_is_refused(tmp_path, janus, t5, capsys):
    folder = variant(janus, tmp_path, lambda f: shutil.copy(t5 / "model.safetensors", f / "model.safetensors"))
    line = one_line_error(capsys, generate(folder, tmp_path, "--prompt", "a red cat"))
    assert f"{folder} does not hold the weights its config.json describes: 206 missing (first 'lm_head.weight'); 19 unexpected (first 'encoder.block.0." in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, expected", [(drop_one, "1 missing (first 'lm_head.weight')"), (add_one, "1 unexpected (first 'extra.weight')")])
def test_a_janus_folder_missing_a_weight_or_with_an_extra_one_is_refused(tmp_path, janus, capsys, change, expected):
    line = one_line_error(capsys, generate(variant(janus, tmp_path, change), tmp_path, "--prompt", "a red cat"))
    assert expected in line and "another model's weights, or a damaged export?" in line


@pytest.mark.parametrize("change, expected", [(drop_one, "1 missing (first 'encoder.block.0."), (add_one, "1 unexpected (first 'extra.weight')")])
def test_a_t5_folder_missing_a_weight_or_with_an_extra_one_is_refused(tmp_path, t5, t2i, capsys, change, expected):
    folder = variant(t5, tmp_path, change)
    line = one_line_error(capsys, generate(t2i, tmp_path, *T2I_FLAGS, "--text-encoder", str(folder), "--prompt", "a red dog"))
    assert f"{folder} does not hold the weights its config.json describes: {expected}" in line


def test_a_t5_folder_with_another_models_weights_is_refused(tmp_path, t5, janus):
    folder = variant(t5, tmp_path, lambda f: shutil.copy(janus / "model.safetensors", f / "model.safetensors"))
    with pytest.raises(SpecimgError, match=r"does not hold the weights its config.json describes: \d+ missing .*; \d+ unexpected"):
        load_text_encoder(folder)


def test_a_whole_t5_folder_loads_its_encoder(tmp_path):
    """flan-t5-xl is a whole T5 with an untied LM head: the decoder and the head are not the encoder's."""
    config = transformers.T5Config(vocab_size=len(T5_WORDS), tie_word_embeddings=False, **T5_SIZES)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "flan")
    t5_tokenizer().save_pretrained(tmp_path / "flan")
    assert load_text_encoder(tmp_path / "flan").dim == 16


# ----------------------------------------------------------------------------- 2. NaN and inf weights


def test_a_llamagen_checkpoint_with_nan_is_refused(tmp_path, capsys):
    state = build_target("GPT-B", **TINY_GPT).state_dict()
    state["layers.1.attention.wo.weight"][3, 4] = float("nan")
    state["output.weight"][0, 0] = float("inf")
    torch.save({"model": state}, tmp_path / "nan.pt")
    line = one_line_error(capsys, generate(tmp_path / "nan.pt", tmp_path, *TINY_FLAGS))
    assert f"{tmp_path / 'nan.pt'}: 2 weight(s) hold NaN or inf values, the first 'layers.1.attention.wo.weight' (float32)" in line


@pytest.fixture
def tiny_files(tmp_path):
    """A tiny LlamaGen checkpoint with its drafter and VQ tokenizer files."""
    target = build_target("GPT-B", **TINY_GPT)
    torch.save({"model": target.state_dict()}, tmp_path / "target.pt")
    save_drafter(build_drafter(target), tmp_path / "drafter.safetensors")
    save_tokenizer(build_tokenizer(**TINY_VQ), tmp_path / "vq.safetensors")
    return tmp_path


@pytest.mark.parametrize("role, name", [("--drafter", "drafter.safetensors"), ("--tokenizer", "vq.safetensors")])
def test_a_drafter_or_tokenizer_with_inf_is_refused(tiny_files, capsys, role, name):
    path = tiny_files / name
    edit_safetensors(path, lambda t: poison(t, float("-inf")))
    line = one_line_error(capsys, generate(tiny_files / "target.pt", tiny_files, *TINY_FLAGS, role, str(path)))
    assert f"{path}: 1 weight(s) hold NaN or inf values" in line


def test_a_demo_format_target_with_nan_is_refused(tmp_path):
    save_target(build_target("GPT-B", **TINY_GPT), tmp_path / "target.safetensors")
    edit_safetensors(tmp_path / "target.safetensors", poison)
    with pytest.raises(SpecimgError, match="1 weight.s. hold NaN or inf values"):
        load_target_file(tmp_path / "target.safetensors")


def test_hugging_face_folders_with_nan_are_refused(tmp_path, janus, t5, capsys):
    folder = variant(janus, tmp_path, lambda f: edit_safetensors(f / "model.safetensors", poison))
    line = one_line_error(capsys, generate(folder, tmp_path, "--prompt", "a red cat"))
    assert f"{folder}: 1 weight(s) hold NaN or inf values" in line
    encoder = tmp_path / "t5"
    shutil.copytree(t5, encoder)
    edit_safetensors(encoder / "model.safetensors", poison)
    with pytest.raises(SpecimgError, match="1 weight.s. hold NaN or inf values"):
        load_text_encoder(encoder)


# ----------------------------------------------------------------------------- 3. --target-config


def test_every_gpt_config_field_has_a_rule():
    assert list(FIELD_RULES) == [f.name for f in attrs.fields(GPTConfig)]


@pytest.mark.parametrize(
    "option, message",
    [
        ("n_head=0", "n_head must be a positive integer, not 0"),
        ("n_kv_head=0", "n_kv_head must be a positive integer, or null for n_head, not 0"),
        ("multiple_of=0", "multiple_of must be a positive integer, not 0"),
        ("dim=2.5", "dim must be a positive integer, not 2.5"),
        ("n_layer=true", "n_layer must be a positive integer, not True"),
        ("vocab_size=abc", "vocab_size must be a positive integer, not 'abc'"),
        ("block_size=1", "block_size must be a square >= 4 (image tokens form a grid, at least 2x2), not 1"),
        ("block_size=-4", "block_size must be a square >= 4"),
        ("block_size=63", "block_size must be a square >= 4"),
        ("rope_base=0", "rope_base must be a finite number > 1, not 0"),
        ("norm_eps=-1", "norm_eps must be a finite number > 0, not -1"),
        ("class_dropout_prob=1", "class_dropout_prob must be a number in [0, 1), not 1"),
        ("model_type=x2i", "model_type must be 'c2i' or 't2i', not 'x2i'"),
        ("attn_implementation=flash_attention_2", "'attn_implementation' is no field (fields: dim, n_layer,"),
        ("max_tree_nodes=0", "max_tree_nodes must be a positive integer, not 0"),
        ("dtype=int8", "dtype must be a floating torch dtype or its name (float32, bfloat16, float16), not 'int8'"),
        ("device=nonsense", "device must be cpu, cuda or cuda:N, not 'nonsense'"),
        ("device=mps", "device must be cpu, cuda or cuda:N, not 'mps'"),
        ("preset=GPT-Q", "unknown LlamaGen preset 'GPT-Q'"),
    ],
)
def test_llamagen_options_are_checked_before_the_file_is_read(tmp_path, capsys, option, message):
    """The checkpoint is not even readable: the option's error comes first."""
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    line = one_line_error(capsys, generate(tmp_path / "junk.pt", tmp_path, "--target-config", option))
    assert message in line and "Attribute(" not in line


def test_a_preset_given_twice_is_refused(tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    line = one_line_error(capsys, generate(tmp_path / "junk.pt", tmp_path, "--preset", "GPT-B", "--target-config", "preset=GPT-B"))
    assert "the preset is given twice, by --preset and by --target-config preset=...: keep one" in line


def test_llamagen_loading_options_that_are_sound_are_taken(tmp_path):
    from specimg.models.llamagen import load_target

    torch.save(build_target("GPT-B", **TINY_GPT).state_dict(), tmp_path / "t.pt")
    target = load_target(tmp_path / "t.pt", dtype="bfloat16", device="cpu", rope_base=10000, **{k: v for k, v in TINY_GPT.items()})
    assert target.tok_embeddings.weight.dtype == torch.bfloat16 and target.config.rope_base == 10000


@pytest.mark.parametrize(
    "option, message",
    [
        ("attn_implementation=flash_attention_2", "bad Janus option: attn_implementation must be sdpa or eager (a draft tree needs a custom 4-D mask"),
        ("dtype=int8", "dtype must be a floating torch dtype or its name"),
        ("device=nonsense", "device must be cpu, cuda or cuda:N, not 'nonsense'"),
        ("preset=GPT-B", "Janus folders take no option 'preset' (their options: device, dtype, attn_implementation)"),
        ("image_size=64", "Janus folders take no option 'image_size'"),
    ],
)
def test_hugging_face_options_are_checked_before_the_folder_is_loaded(tmp_path, capsys, option, message):
    (tmp_path / "janus").mkdir()
    (tmp_path / "janus" / "config.json").write_text(json.dumps({"model_type": "janus"}))  # no weights: never read
    line = one_line_error(capsys, generate(tmp_path / "janus", tmp_path, "--prompt", "a cat", "--target-config", option))
    assert message in line and "Attribute(" not in line


@pytest.mark.parametrize("size", ["65", "64.0", "true", '"64"'])
def test_lumina_image_size_is_a_multiple_of_32(size):
    from specimg.models.lumina import LuminaOptions
    from specimg.models.hf import parse_options

    with pytest.raises(SpecimgError, match="bad Lumina-mGPT option: image_size must be a positive multiple of 32"):
        parse_options(LuminaOptions, {"image_size": json.loads(size)}, "Lumina-mGPT")


# ----------------------------------------------------------------------------- 4. damaged files


def not_utf8(folder) -> None:
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_bytes(text.encode("utf-16"))


def test_a_config_json_that_is_not_utf8_is_refused(tmp_path, janus, t5, capsys):
    folder = variant(janus, tmp_path, not_utf8)
    line = one_line_error(capsys, generate(folder, tmp_path, "--prompt", "a red cat"))
    assert f"{folder / 'config.json'}: byte 0 is not UTF-8 (a config.json is UTF-8 JSON)" in line
    encoder = tmp_path / "t5"
    shutil.copytree(t5, encoder)
    not_utf8(encoder)
    with pytest.raises(SpecimgError, match="byte 0 is not UTF-8"):
        load_text_encoder(encoder)


def test_a_truncated_model_safetensors_is_refused(tmp_path, janus, capsys):
    def truncate(folder) -> None:
        weights = folder / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)

    folder = variant(janus, tmp_path, truncate)
    line = one_line_error(capsys, generate(folder, tmp_path, "--prompt", "a red cat"))
    assert f"a weights file in {folder} is cut short or damaged: Error while deserializing header" in line


def test_weights_of_another_shape_than_the_config_are_refused(tmp_path, janus, t5, capsys):
    def narrower(folder) -> None:
        config = json.loads((folder / "config.json").read_text())
        config["text_config"]["intermediate_size"] = 40
        (folder / "config.json").write_text(json.dumps(config))

    folder = variant(janus, tmp_path, narrower)
    line = one_line_error(capsys, generate(folder, tmp_path, "--prompt", "a red cat"))
    assert "6 of another shape than its config.json gives (first 'model.language_model.layers.0.mlp.down_proj.weight')" in line
    encoder = tmp_path / "t5"
    shutil.copytree(t5, encoder)
    config = json.loads((encoder / "config.json").read_text())
    (encoder / "config.json").write_text(json.dumps({**config, "d_ff": 24}))
    with pytest.raises(SpecimgError, match="4 of another shape than its config.json gives"):
        load_text_encoder(encoder)


def test_a_t5_folder_without_tokenizer_files_is_refused(tmp_path, t5, t2i, capsys):
    def untokenized(folder) -> None:
        for name in os.listdir(folder):
            if "token" in name:
                os.remove(folder / name)

    folder = variant(t5, tmp_path, untokenized)
    line = one_line_error(capsys, generate(t2i, tmp_path, *T2I_FLAGS, "--text-encoder", str(folder), "--prompt", "a red dog"))
    assert f"{folder} has no tokenizer (tokenizer.json or spiece.model): copy the T5 model's tokenizer files beside its weights" in line


def test_a_folder_of_another_model_is_no_t5_encoder(janus):
    with pytest.raises(SpecimgError, match="holds a 'janus' model, not a T5 encoder"):
        load_text_encoder(janus)


@pytest.mark.parametrize("header, message", [
    ({"kind": "hash", "buckets": 257, "max_length": 16}, "needs dim as a positive integer, not None"),
    ({"kind": "hash", "dim": "16", "buckets": 257, "max_length": 16}, "needs dim as a positive integer, not '16'"),
    ({"kind": "hash", "dim": 12, "buckets": 257, "max_length": 16}, "key 'table' has shape (257, 16), the model expects (257, 12)"),
])
def test_a_specimg_text_encoder_file_with_a_bad_header_is_refused(tmp_path, t2i, capsys, header, message):
    path = tmp_path / "enc.safetensors"
    HashTextEncoder(dim=16).save(path)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(path), metadata={"specimg.text_encoder": json.dumps(header)})
    line = one_line_error(capsys, generate(t2i, tmp_path, *T2I_FLAGS, "--text-encoder", str(path), "--prompt", "a red dog"))
    assert message in line


def test_a_llamagen_checkpoint_of_another_shape_is_refused(tmp_path, capsys):
    torch.save(build_target("GPT-B", **TINY_GPT).state_dict(), tmp_path / "t.pt")
    line = one_line_error(capsys, generate(tmp_path / "t.pt", tmp_path, *TINY_FLAGS, "--target-config=multiple_of=256"))
    assert "key 'layers.0.feed_forward.w1.weight' has shape (192, 64), the model expects (256, 64); wrong preset or config?" in line
