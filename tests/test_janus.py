"""Janus-Pro target on a tiny random transformers Janus: greedy tokens equal transformers' own
image generation, tree verification equals sequential decoding, commits keep the path."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import JanusForConditionalGeneration  # noqa: E402

from specimg import Engine, Sampling, TreeConfig  # noqa: E402
from specimg.errors import SpecimgError  # noqa: E402
from specimg.models.base import Target, causal_tree_mask  # noqa: E402
from specimg.models.janus import JanusTarget, load_janus_target  # noqa: E402
from specimg.testing.markov import MarkovDrafter  # noqa: E402
from specimg.testing.tiny_hf import JANUS_BOI as BOI, JANUS_BOS as BOS, JANUS_PAD as PAD, JANUS_WORDS as WORDS, save_tiny_janus  # noqa: E402
from specimg.testing.trees import path_to, random_tree  # noqa: E402

PROMPT = torch.tensor([BOS, 21, 30, 7, 44, 12, BOI])
ATOL = 1e-4  # float32 rounding on logits of size ~10 (the weights are large on purpose)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A saved tiny Janus whose weights are large enough for varied greedy tokens."""
    path = tmp_path_factory.mktemp("janus")
    save_tiny_janus(path)
    return path


@pytest.fixture(scope="module")
def target(folder) -> JanusTarget:
    return load_janus_target(folder)


def transformers_tokens(folder, prompt: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    model = JanusForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    ids = prompt[None]
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_mode="image", do_sample=False, guidance_scale=cfg_scale
    )[0]


def greedy(target: JanusTarget, method: str, cfg_scale: float, drafter=None, prompt=PROMPT):
    engine = Engine(target, drafter, method=method, sampling=Sampling(temperature=0.0, cfg_scale=cfg_scale),
                    tree=TreeConfig(depth=4, topk=3, total_tokens=10), tokenizer=target.vq_tokenizer())
    return engine.generate([prompt])


def decode_chain(target: JanusTarget, tokens: list[int], cfg: bool = True):
    """Fresh prefill, then one token per forward_tree + commit; the last outputs."""
    out = target.prefill(PROMPT, cfg)
    for tok in tokens:
        out = target.forward_tree(torch.tensor([tok]), torch.tensor([0]), causal_tree_mask(1))
        target.commit(torch.tensor([0]))
    return out


@pytest.mark.parametrize("cfg_scale,prompt", [(3.0, PROMPT), (5.0, torch.tensor([BOS, 9, 9, 60, BOI]))])
def test_greedy_ar_equals_transformers_image_generation(folder, target, cfg_scale: float, prompt: torch.Tensor) -> None:
    expected = transformers_tokens(folder, prompt, cfg_scale)
    tokens, stats = greedy(target, "ar", cfg_scale, prompt=prompt)
    assert len(set(expected.tolist())) > 4, "a degenerate reference proves little"
    assert tokens[0].tolist() == expected.tolist()
    assert stats.images[0].target_forwards == target.num_tokens


def test_greedy_naive_equals_ar(target) -> None:
    """A drafter that often guesses right, so accepted paths of several nodes are committed."""
    ar, _ = greedy(target, "ar", 3.0)
    seq = ar[0].tolist()
    table = torch.randn(target.vocab_size, target.vocab_size, generator=torch.Generator().manual_seed(0))
    for prev, nxt in zip(seq, seq[1:]):
        table[prev, nxt] += 10.0
    naive, stats = greedy(target, "naive", 3.0, MarkovDrafter(table))
    assert naive.tolist() == ar.tolist()
    assert max(stats.images[0].accepted) >= 2
    assert stats.images[0].target_forwards < target.num_tokens


@pytest.mark.parametrize("method", ["cascade+lantern", "gsd"])
def test_relaxed_methods_run_on_janus_features(target, method: str) -> None:
    """CASCADE reads the hidden states, LANTERN the VQ codebook, GSD the input embeddings."""
    table = torch.zeros(target.vocab_size, target.vocab_size)
    engine = Engine(target, MarkovDrafter(table), method=method, sampling=Sampling(cfg_scale=3.0),
                    tree=TreeConfig(depth=3, topk=2, total_tokens=6), tokenizer=target.vq_tokenizer())
    tokens, stats = engine.generate([PROMPT], seed=1)
    assert tokens.shape == (1, target.num_tokens) and 0 <= int(tokens.min()) and int(tokens.max()) < target.vocab_size
    assert stats.images[0].target_forwards <= target.num_tokens
    assert target.vq_tokenizer().decode(tokens).isfinite().all()


@pytest.mark.parametrize("cfg", [True, False])
def test_tree_verification_equals_sequential_decoding(target, cfg: bool) -> None:
    assert isinstance(target, Target)
    prefix = [7, 1, 30]
    decode_chain(target, prefix, cfg)
    tokens, depths, mask, parents = random_tree(10, target.vocab_size, seed=1)
    tree = target.forward_tree(tokens, depths, mask)
    rows = 2 if cfg else 1
    assert tree.logits.shape == (rows, 10, target.vocab_size) and tree.logits.dtype == torch.float32
    assert tree.hidden.shape == (rows, 10, target.hidden_size)
    for node in range(10):
        chain = decode_chain(target, prefix + tokens[path_to(node, parents)].tolist(), cfg)
        torch.testing.assert_close(tree.logits[:, node], chain.logits[:, 0], atol=ATOL, rtol=0)
        torch.testing.assert_close(tree.hidden[:, node], chain.hidden[:, 0], atol=ATOL, rtol=0)


def test_commit_keeps_exactly_the_accepted_path(target) -> None:
    committed = [4, 9]
    decode_chain(target, committed)
    tokens, depths, mask, parents = random_tree(10, target.vocab_size, seed=2)
    target.forward_tree(tokens, depths, mask)
    accepted = path_to(9, parents)
    assert len(accepted) >= 3
    target.commit(torch.tensor(accepted))
    nxt_tokens, nxt_depths, nxt_mask, nxt_parents = random_tree(5, target.vocab_size, seed=3)
    nxt = target.forward_tree(nxt_tokens, nxt_depths, nxt_mask)
    for node in range(5):
        seq = committed + tokens[accepted].tolist() + nxt_tokens[path_to(node, nxt_parents)].tolist()
        chain = decode_chain(target, seq)
        torch.testing.assert_close(nxt.logits[:, node], chain.logits[:, 0], atol=ATOL, rtol=0)


def test_eager_attention_takes_the_tree_mask_too(folder, target) -> None:
    eager = load_janus_target(folder, attn_implementation="eager")
    tokens, depths, mask, _ = random_tree(8, target.vocab_size, seed=6)
    outs = []
    for model in (target, eager):
        decode_chain(model, [7, 1, 30])
        outs.append(model.forward_tree(tokens, depths, mask).logits)
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)


def test_bfloat16_weights_give_float32_logits_close_to_float32(folder, target) -> None:
    low = load_janus_target(folder, dtype="bfloat16")
    tokens, depths, mask, _ = random_tree(8, target.vocab_size, seed=5)
    outs = []
    for model in (target, low):
        decode_chain(model, [7, 1, 30])
        outs.append(model.forward_tree(tokens, depths, mask))
    assert outs[1].logits.dtype == torch.float32 and outs[1].hidden.dtype == torch.bfloat16
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=2.0, rtol=0.1)  # logits reach ~20


def test_text_prompt_in_janus_template_and_unconditional_row(target) -> None:
    words = {w: i for i, w in enumerate(WORDS)}
    ids = target.prompt_ids("  a red cat ")
    assert ids.tolist() == [BOS, words["<|User|>:"], words["a"], words["red"], words["cat"], words["<|Assistant|>:"], BOI]
    text = target.prefill("a red cat", cfg=True).logits
    torch.testing.assert_close(text, target.prefill(ids, cfg=True).logits, atol=0, rtol=0)
    uncond = torch.tensor([BOS, PAD, PAD, PAD, PAD, PAD, BOI])
    torch.testing.assert_close(text[1], target.prefill(uncond, cfg=False).logits[0], atol=ATOL, rtol=0)
    assert not torch.allclose(text[0], text[1])


def test_embeddings_and_vq_tokenizer_are_janus_generation_path(folder, target) -> None:
    model = JanusForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    codes = torch.arange(target.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(target.input_embeddings(), model.prepare_embeddings_for_image_generation(codes))
        tok = target.vq_tokenizer()
        assert tok.vocab_size == target.vocab_size
        grid = torch.randint(0, target.vocab_size, (2, target.num_tokens), generator=torch.Generator().manual_seed(4))
        images = tok.decode(grid)
        assert images.shape == (2, 3, 8, 8)
        torch.testing.assert_close(images, model.decode_image_tokens(grid).permute(0, 3, 1, 2))
        vectors = model.model.vqmodel.quantize.get_codebook_entry(codes[None, : target.num_tokens])
        torch.testing.assert_close(tok.codebook_vectors()[: target.num_tokens], vectors[0].flatten(1).T)
        raw = tok.raw_codebook_vectors()  # LANTERN's codebook=raw: the stored weight, before Janus normalises it
        assert torch.equal(raw, model.model.vqmodel.quantize.embedding.weight) and torch.allclose(F.normalize(raw, dim=-1), tok.codebook_vectors())
    with pytest.raises(SpecimgError, match="codes must lie"):
        tok.decode(torch.full((1, target.num_tokens), target.vocab_size))


def test_user_errors(tmp_path, folder, target) -> None:
    with pytest.raises(SpecimgError, match="begin-of-image"):
        target.prefill([BOS, 9, 10], cfg=True)
    with pytest.raises(SpecimgError, match="options: device, dtype, attn_implementation"):
        load_janus_target(folder, max_tree_nodes=3)
    with pytest.raises(SpecimgError, match="no config.json"):
        load_janus_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "chameleon"}))
    with pytest.raises(SpecimgError, match="not a 'janus' one"):
        load_janus_target(tmp_path)
