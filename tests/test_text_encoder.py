"""The T5 text encoder path LlamaGen's t2i models use, on a tiny T5 and tokenizer built
offline: features of the valid tokens, left-padded into the target's caption slots."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specimg.models.text_encoder import T5TextEncoder, captions_for_target, load_text_encoder  # noqa: E402

WORDS = ["a", "red", "cube", "dog", "on", "grass", "two", "cats"]


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory) -> str:
    """A Hugging Face folder as flan-t5-xl's, at toy size: T5 encoder weights and a fast
    tokenizer that ends every text with </s>, as T5's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder = str(tmp_path_factory.mktemp("t5"))
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_input_names=["input_ids", "attention_mask"]
    )
    fast.save_pretrained(folder)
    config = transformers.T5Config(vocab_size=len(vocab), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
    torch.manual_seed(0)
    transformers.T5EncoderModel(config).save_pretrained(folder)
    return folder


def test_valid_features_are_left_padded_and_do_not_depend_on_the_batch(t5_folder):
    enc = load_text_encoder(t5_folder)
    assert isinstance(enc, T5TextEncoder) and enc.dim == 16
    texts = ["a red cube", "two cats on grass", "dog"]
    caps = captions_for_target(enc, texts, 6, 16)
    assert [c.mask.tolist() for c in caps] == [[False, False] + [True] * 4, [False] + [True] * 5, [False] * 4 + [True] * 2]
    for text, cap in zip(texts, caps):
        alone = enc.model(**enc.tokenizer([text], return_tensors="pt")).last_hidden_state[0]
        torch.testing.assert_close(cap.features[cap.mask], alone, atol=1e-5, rtol=0)
        assert torch.equal(cap.features[~cap.mask], torch.zeros(int((~cap.mask).sum()), 16))


def test_at_most_120_tokens_as_llamagen(t5_folder):
    enc = load_text_encoder(t5_folder)
    long = " ".join(WORDS[i % len(WORDS)] for i in range(150))
    (cap,) = captions_for_target(enc, [long], 130, 16)
    assert int(cap.mask.sum()) == 120 and cap.mask[-120:].all()


def test_generate_with_a_t5_folder(tmp_path, t5_folder, tiny_preset, capsys):
    import argparse

    from specimg.cli import main
    from specimg.models.llamagen import build_target
    from specimg.models.loading import TINY_GPT

    args = argparse.Namespace(gpt_model="GPT-T", gpt_type="t2i", vocab_size=256, cls_token_num=8, image_size=16, downsample_size=4)
    target = build_target("GPT-B", seed=0, **{**TINY_GPT, "model_type": "t2i", "cls_token_num": 8, "caption_dim": 16, "block_size": 16})
    torch.save({"model": target.state_dict(), "args": args}, tmp_path / "t2i.pt")
    out = tmp_path / "out"
    main(["generate", "--target", str(tmp_path / "t2i.pt"), "--text-encoder", t5_folder, "--prompt", "a red dog", "-m", "ar", "-n", "1", "--out", str(out)])
    entry = json.loads((out / "manifest.jsonl").read_text())
    assert entry["prompt"] == "a red dog" and len(entry["tokens"]) == 16 and not os.path.exists(out / "images" / "00000.png")
