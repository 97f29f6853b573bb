"""Tiny random Janus and Lumina-mGPT folders, saved as the released conversions are laid out,
so tests drive the Hugging Face targets offline: from Python, through ``load_target`` and
from the command line alike.  Weights are drawn large on purpose, so greedy decoding gives
varied tokens."""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    ChameleonConfig, ChameleonForConditionalGeneration, JanusConfig, JanusForConditionalGeneration, PreTrainedModel,
    PreTrainedTokenizerFast,
)

# -- Janus: 4x4 image tokens, 48 codes, a 2-layer Llama with grouped KV heads, 8x8 images

JANUS_BOS, JANUS_PAD, JANUS_BOI = 1, 2, 4
JANUS_WORDS = ["<unk>", "<bos>", "<pad>", "<eos>", "<begin_of_image>", "<|User|>:", "<|Assistant|>:", "a", "red", "cat"]


def janus_config() -> JanusConfig:
    return JanusConfig(
        text_config=dict(
            model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=JANUS_BOS, pad_token_id=JANUS_PAD, eos_token_id=3,
        ),
        vision_config=dict(
            image_size=64, patch_size=16, num_image_tokens=16, hidden_size=32, projection_dim=32,
            num_hidden_layers=1, num_attention_heads=4, mlp_ratio=2,
        ),
        vq_config=dict(
            embed_dim=8, num_embeddings=48, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
            num_res_blocks=1, projection_dim=32, image_token_embed_dim=32,
        ),
        image_token_id=5,
    )


def janus_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer that adds BOS, standing in for Janus's."""
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(JANUS_WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", JANUS_BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", pad_token="<pad>", unk_token="<unk>")


def save_tiny_janus(path: str | os.PathLike[str]) -> None:
    """A tiny random Janus with its tokenizer and a generation config as the conversions write it."""
    model = _large_random(JanusForConditionalGeneration, janus_config())
    gen = model.generation_config
    gen._from_model_config, gen.bos_token_id, gen.pad_token_id = False, JANUS_BOS, JANUS_PAD
    gen.generation_kwargs = {"boi_token_id": JANUS_BOI}
    model.save_pretrained(path)
    janus_tokenizer().save_pretrained(path)


# -- Lumina-mGPT: 64-px images (4x4 codes, size token <reserved08802>), 20 codes at BPE ids
# 10..29 in reverse code order, a 2-layer Chameleon

LUMINA_CODES = 20
LUMINA_SIDE = 4
LUMINA_FIRST_CODE_BPE = 10
LUMINA_START, LUMINA_NEWLINE, LUMINA_SIZE = 4, 5, 6
LUMINA_WORDS = ["Generate", "an", "image", "of", "64x64", "according", "to", "the", "following", "prompt:", "a", "red", "cat"]
LUMINA_FIRST_WORD = 30


def code_name(code: int) -> str:
    """Chameleon's image token name: the code's digits as letters A-J, between IMGIMG and Z."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def code_bpe(code: int) -> int:
    return LUMINA_FIRST_CODE_BPE + LUMINA_CODES - 1 - code


def lumina_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with the turn separator as a special token."""
    vocab = {"<unk>": 0, "<reserved08706>": 7, **{w: LUMINA_FIRST_WORD + i for i, w in enumerate(LUMINA_WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", additional_special_tokens=["<reserved08706>"])


def lumina_config() -> ChameleonConfig:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<racm3:break>": LUMINA_START, "<reserved08799>": LUMINA_NEWLINE,
             "<reserved08802>": LUMINA_SIZE, "<reserved08706>": 7, "<eoss>": 8}
    vocab.update({code_name(c): code_bpe(c) for c in range(LUMINA_CODES)})
    return ChameleonConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocabulary_map=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        vq_config=dict(embed_dim=8, num_embeddings=LUMINA_CODES, latent_channels=8, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, resolution=16),
    )


def save_tiny_lumina(path: str | os.PathLike[str]) -> None:
    """A tiny random Lumina-mGPT (Chameleon) with its tokenizer; load it with ``image_size=64``."""
    _large_random(ChameleonForConditionalGeneration, lumina_config()).save_pretrained(path)
    lumina_tokenizer().save_pretrained(path)


def _large_random(cls: type[PreTrainedModel], config: object) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
        for name, p in model.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, 0.0, 0.5)
    return model
