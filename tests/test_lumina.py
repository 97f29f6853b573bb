"""Lumina-mGPT target on a tiny random transformers Chameleon: tree verification equals an
independent full-sequence run with the size tokens and forced newlines laid out as
Lumina-mGPT does, greedy naive equals greedy ar, and Chameleon's VQGAN decoder loads the
released key names."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import ChameleonForConditionalGeneration  # noqa: E402

from specimg import Engine, Sampling, TreeConfig  # noqa: E402
from specimg.errors import SpecimgError  # noqa: E402
from specimg.models.base import Target, causal_tree_mask  # noqa: E402
from specimg.models.chameleon_vq import ChameleonVQDecoder, ChameleonVQConfig, load_chameleon_vq_decoder  # noqa: E402
from specimg.models.lumina import LuminaTarget, load_lumina_target  # noqa: E402
from specimg.testing.markov import MarkovDrafter  # noqa: E402
from specimg.testing.tiny_hf import LUMINA_CODES as CODES, LUMINA_FIRST_WORD as FIRST_WORD, LUMINA_NEWLINE as NEWLINE  # noqa: E402
from specimg.testing.tiny_hf import LUMINA_SIDE as SIDE, LUMINA_SIZE as SIZE, LUMINA_START as START, LUMINA_WORDS as WORDS  # noqa: E402
from specimg.testing.tiny_hf import code_bpe, save_tiny_lumina  # noqa: E402
from specimg.testing.trees import path_to, random_tree  # noqa: E402

PROMPT = torch.tensor([1, 40, 33, 47, 7])
ATOL = 1e-4  # float32 rounding on logits of size ~10 (the weights are large on purpose)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("lumina")
    save_tiny_lumina(path)
    return path


@pytest.fixture(scope="module")
def target(folder) -> LuminaTarget:
    return load_lumina_target(folder, image_size=64)


@pytest.fixture(scope="module")
def reference(folder) -> ChameleonForConditionalGeneration:
    return ChameleonForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()


def layout(codes: list[int], newlines: bool = True) -> list[int]:
    """Lumina-mGPT's image stream: start, size, size, then each row's codes and a newline."""
    stream = [START, SIZE, SIZE]
    for i, code in enumerate(codes):
        stream.append(code_bpe(code))
        if newlines and i % SIDE == SIDE - 1 and i + 1 < SIDE * SIDE:
            stream.append(NEWLINE)
    return stream


def reference_logits(model, codes: list[int], newlines: bool = True) -> torch.Tensor:
    """[2, V] code logits after ``codes``, each row run whole and uncached: the prompt then the
    stream (conditional), the stream alone from position 0 (unconditional)."""
    stream = layout(codes, newlines)
    rows = []
    for ids in (PROMPT.tolist() + stream, stream):
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        rows.append(model.lm_head(hidden)[[code_bpe(c) for c in range(CODES)]])
    return torch.stack(rows)


def decode_chain(target: LuminaTarget, tokens: list[int], cfg: bool = True):
    out = target.prefill(PROMPT, cfg)
    for tok in tokens:
        out = target.forward_tree(torch.tensor([tok]), torch.tensor([0]), causal_tree_mask(1))
        target.commit(torch.tensor([0]))
    return out


def greedy(target: LuminaTarget, method: str, drafter=None):
    engine = Engine(target, drafter, method=method, sampling=Sampling(temperature=0.0, cfg_scale=3.0),
                    tree=TreeConfig(depth=4, topk=3, total_tokens=10))
    return engine.generate([PROMPT])


def test_prefill_and_chain_equal_lumina_layout_run_whole(target, reference) -> None:
    assert isinstance(target, Target) and (target.vocab_size, target.num_tokens) == (CODES, SIDE * SIDE)
    codes = [3, 17, 0, 9, 9, 12]  # crosses a row end: a forced newline
    for k in (0, 3, 4, 6):
        torch.testing.assert_close(decode_chain(target, codes[:k]).logits[:, 0], reference_logits(reference, codes[:k]), atol=ATOL, rtol=0)
    assert not torch.allclose(decode_chain(target, codes[:4]).logits[:, 0], reference_logits(reference, codes[:4], newlines=False), atol=0.1)


@pytest.mark.parametrize("prefix", [[7, 1], [7, 1, 10, 2, 5]])
def test_tree_verification_equals_lumina_layout_run_whole(target, reference, prefix: list[int]) -> None:
    decode_chain(target, prefix)
    tokens, depths, mask, parents = random_tree(12, target.vocab_size, seed=len(prefix))
    tree = target.forward_tree(tokens, depths, mask)
    assert tree.logits.shape == (2, 12, CODES) and tree.hidden.shape == (2, 12, target.hidden_size)
    for node in range(12):
        expected = reference_logits(reference, prefix + tokens[path_to(node, parents)].tolist())
        torch.testing.assert_close(tree.logits[:, node], expected, atol=ATOL, rtol=0)


def test_commit_keeps_the_path_and_its_newlines(target, reference) -> None:
    committed = [4, 9]
    decode_chain(target, committed)
    tokens, depths, mask, parents = random_tree(10, target.vocab_size, seed=7)
    target.forward_tree(tokens, depths, mask)
    accepted = path_to(9, parents)
    assert len(committed) + len(accepted) > SIDE  # the path crosses a row end
    target.commit(torch.tensor(accepted))
    nxt_tokens, nxt_depths, nxt_mask, nxt_parents = random_tree(5, target.vocab_size, seed=8)
    nxt = target.forward_tree(nxt_tokens, nxt_depths, nxt_mask)
    for node in range(5):
        codes = committed + tokens[accepted].tolist() + nxt_tokens[path_to(node, nxt_parents)].tolist()
        torch.testing.assert_close(nxt.logits[:, node], reference_logits(reference, codes), atol=ATOL, rtol=0)


def test_greedy_naive_equals_ar(target) -> None:
    ar, _ = greedy(target, "ar")
    seq = ar[0].tolist()
    assert len(set(seq)) > 4, "a degenerate sequence proves little"
    table = torch.randn(CODES, CODES, generator=torch.Generator().manual_seed(0))
    for prev, nxt in zip(seq, seq[1:]):
        table[prev, nxt] += 10.0
    naive, stats = greedy(target, "naive", MarkovDrafter(table))
    assert naive.tolist() == ar.tolist()
    assert max(stats.images[0].accepted) >= 2


@pytest.mark.parametrize("method", ["cascade+lantern", "gsd"])
def test_relaxed_methods_run_on_lumina_features(target, method: str) -> None:
    """CASCADE reads the hidden states, LANTERN the VQGAN codebook, GSD the input embeddings."""
    tokenizer = ChameleonVQDecoder(ChameleonVQConfig(n_embed=CODES, embed_dim=8, z_channels=16, ch=32, ch_mult=(1,), num_res_blocks=1))
    engine = Engine(target, MarkovDrafter(torch.zeros(CODES, CODES)), method=method, sampling=Sampling(cfg_scale=3.0),
                    tree=TreeConfig(depth=3, topk=2, total_tokens=6), tokenizer=tokenizer)
    tokens, stats = engine.generate([PROMPT], seed=1)
    assert tokens.shape == (1, target.num_tokens) and 0 <= int(tokens.min()) and int(tokens.max()) < CODES
    assert stats.images[0].target_forwards <= target.num_tokens
    assert tokenizer.decode(tokens).shape == (1, 3, SIDE, SIDE)


def test_without_cfg_one_row_equals_the_conditional_row(target) -> None:
    both = decode_chain(target, [1, 2, 3, 4, 5])
    one = decode_chain(target, [1, 2, 3, 4, 5], cfg=False)
    assert one.logits.shape[0] == 1
    torch.testing.assert_close(one.logits[0], both.logits[0], atol=ATOL, rtol=0)


def released_vqgan_keys(config: ChameleonVQConfig) -> set[str]:
    """The decoder-side key names of taming's VQModel as the released vqgan.ckpt has them."""
    keys = {"post_quant_conv.weight", "post_quant_conv.bias", "quantize.embedding.weight",
            "decoder.conv_in.weight", "decoder.conv_in.bias", "decoder.norm_out.weight", "decoder.norm_out.bias",
            "decoder.conv_out.weight", "decoder.conv_out.bias"}
    resnet = ["norm1", "conv1", "norm2", "conv2"]
    for block in ("block_1", "block_2"):
        keys |= {f"decoder.mid.{block}.{m}.{p}" for m in resnet for p in ("weight", "bias")}
    keys |= {f"decoder.mid.attn_1.{m}.{p}" for m in ("norm", "q", "k", "v", "proj_out") for p in ("weight", "bias")}
    widths = [config.ch * m for m in config.ch_mult]
    block_in = widths[-1]
    for level in reversed(range(len(widths))):
        for i in range(config.num_res_blocks + 1):
            keys |= {f"decoder.up.{level}.block.{i}.{m}.{p}" for m in resnet for p in ("weight", "bias")}
            if (block_in if i == 0 else widths[level]) != widths[level]:
                keys |= {f"decoder.up.{level}.block.{i}.nin_shortcut.{p}" for p in ("weight", "bias")}
        if level:
            keys |= {f"decoder.up.{level}.upsample.conv.{p}" for p in ("weight", "bias")}
        block_in = widths[level]
    return keys


def test_vqgan_decoder_loads_the_released_key_names(tmp_path) -> None:
    config = ChameleonVQConfig(n_embed=CODES, embed_dim=8, z_channels=16, ch=32, ch_mult=(1, 2), num_res_blocks=1, resolution=64)
    model = ChameleonVQDecoder(config)
    state = model.state_dict()
    assert set(state) == released_vqgan_keys(config)
    extra = {"encoder.conv_in.weight": torch.zeros(3), "quant_conv.weight": torch.zeros(3), "loss.discriminator.main.0.weight": torch.zeros(3)}
    torch.save({"state_dict": {**state, **extra}}, tmp_path / "vqgan.ckpt")
    loaded = load_chameleon_vq_decoder(tmp_path / "vqgan.ckpt", **{k: getattr(config, k) for k in ("n_embed", "embed_dim", "z_channels", "ch", "ch_mult", "num_res_blocks", "resolution")})
    codes = torch.randint(0, CODES, (2, 16), generator=torch.Generator().manual_seed(0))
    images = loaded.decode(codes)
    assert images.shape == (2, 3, 8, 8)
    torch.testing.assert_close(images, model.eval().decode(codes))
    torch.testing.assert_close(loaded.codebook_vectors(), state["quantize.embedding.weight"])
    assert torch.equal(loaded.raw_codebook_vectors(), loaded.codebook_vectors())  # Chameleon's codes are not normalised
    with pytest.raises(SpecimgError, match="codes must lie"):
        loaded.decode(torch.full((1, 16), CODES))


def test_text_prompt_in_lumina_template(target) -> None:
    ids = target.prompt_ids(" a red cat ")
    assert ids.tolist() == [1, *range(FIRST_WORD, FIRST_WORD + len(WORDS)), 7]
    torch.testing.assert_close(target.prefill("a red cat", cfg=True).logits, target.prefill(ids, cfg=True).logits, atol=0, rtol=0)


def test_user_errors(tmp_path, folder) -> None:
    with pytest.raises(SpecimgError, match="multiple of 32"):
        load_lumina_target(folder, image_size=48)
    with pytest.raises(SpecimgError, match="size token"):
        load_lumina_target(folder, image_size=96)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "janus"}))
    with pytest.raises(SpecimgError, match="not a 'chameleon' one"):
        load_lumina_target(tmp_path)
