"""LlamaGen target: tree verification equals sequential decoding, commits, checkpoints, presets."""

from __future__ import annotations

import argparse

import pytest
import torch

from specimg.errors import SpecimgError
from specimg.models.base import Caption, Target, causal_tree_mask
from specimg.models.llamagen import (
    PRESETS,
    LlamaGenTarget,
    build_target,
    load_target,
    make_config,
    rope_table,
)
from specimg.testing.trees import path_to, random_tree

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)
TINY_T2I = dict(TINY, model_type="t2i", cls_token_num=6, caption_dim=24)
ATOL = 1e-5


def tiny(kind: str = "c2i", mode: str = "eager", **extra: object) -> LlamaGenTarget:
    target = build_target("GPT-B", seed=0, **{**(TINY if kind == "c2i" else TINY_T2I), **extra})
    target.set_step_mode(mode)
    return target


def condition_for(target: LlamaGenTarget, seed: int = 0) -> int | Caption:
    if target.config.model_type == "c2i":
        return 3
    g = torch.Generator().manual_seed(seed)
    c = target.config
    mask = torch.ones(c.cls_token_num, dtype=torch.bool)
    mask[:2] = False  # left padding, as LlamaGen's sampler arranges T5 features
    return Caption(torch.randn(c.cls_token_num, c.caption_dim, generator=g), mask)


def decode_chain(target: LlamaGenTarget, condition: int | Caption, tokens: list[int]):
    """Fresh prefill, then one token per forward_tree + commit; outputs after each token."""
    out = target.prefill(condition, cfg=True)
    outs = [out]
    for tok in tokens:
        out = target.forward_tree(torch.tensor([tok]), torch.tensor([0]), causal_tree_mask(1))
        target.commit(torch.tensor([0]))
        outs.append(out)
    return outs


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("kind,extra", [("c2i", {}), ("c2i", {"n_kv_head": 2}), ("t2i", {})])
def test_tree_verification_equals_sequential_decoding(kind: str, extra: dict, mode: str) -> None:
    """In both step modes: static pads the 12 nodes to 16 and attends over the whole cache."""
    target = tiny(kind, mode, **extra)
    assert isinstance(target, Target)
    cond = condition_for(target)
    prefix = [7, 1, 30]
    decode_chain(target, cond, prefix)
    tokens, depths, mask, parents = random_tree(12, target.vocab_size, seed=1)
    tree = target.forward_tree(tokens, depths, mask)
    assert tree.logits.shape == (2, 12, target.vocab_size) and tree.logits.dtype == torch.float32
    assert tree.hidden.shape == (2, 12, target.hidden_size)
    for node in range(12):
        chain = decode_chain(target, cond, prefix + tokens[path_to(node, parents)].tolist())[-1]
        torch.testing.assert_close(tree.logits[:, node], chain.logits[:, 0], atol=ATOL, rtol=0)
        torch.testing.assert_close(tree.hidden[:, node], chain.hidden[:, 0], atol=ATOL, rtol=0)


def test_rows_differ_and_single_row_matches_conditional_row() -> None:
    target = tiny()
    both = target.prefill(3, cfg=True)
    assert not torch.allclose(both.logits[0], both.logits[1])
    one = target.prefill(3, cfg=False)
    torch.testing.assert_close(one.logits[0], both.logits[0], atol=ATOL, rtol=0)
    step = target.forward_tree(torch.tensor([5]), torch.tensor([0]), causal_tree_mask(1))
    assert step.logits.shape == (1, 1, target.vocab_size)


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("kind", ["c2i", "t2i"])
def test_commit_then_next_step_equals_fresh_full_sequence(kind: str, mode: str) -> None:
    target = tiny(kind, mode)
    cond = condition_for(target)
    committed = [4, 9]
    decode_chain(target, cond, committed)
    tokens, depths, mask, parents = random_tree(10, target.vocab_size, seed=2)
    target.forward_tree(tokens, depths, mask)
    accepted = path_to(9, parents)  # a root-to-node path
    target.commit(torch.tensor(accepted))
    new_root = 17
    nxt_tokens, nxt_depths, nxt_mask, _ = random_tree(5, target.vocab_size, seed=3)
    nxt_tokens[0] = new_root
    nxt = target.forward_tree(nxt_tokens, nxt_depths, nxt_mask)

    seq = torch.tensor(committed + tokens[accepted].tolist() + [new_root, 0])
    if kind == "c2i":
        conds: torch.Tensor | list[Caption] = torch.tensor([cond, target.config.num_classes])
    else:
        assert isinstance(cond, Caption)
        conds = [cond, Caption(target.cls_embedding.uncond_embedding, cond.mask)]
    with torch.no_grad():
        full = target.forward_sequence(conds, seq.expand(2, -1))
    torch.testing.assert_close(nxt.logits[:, 0], full.logits[:, -1], atol=ATOL, rtol=0)
    torch.testing.assert_close(nxt.hidden[:, 0], full.hidden[:, -1], atol=ATOL, rtol=0)


def test_caption_padding_is_ignored() -> None:
    """Features under mask 0 must not change any image-token output (LlamaGen's emb_masks)."""
    target = tiny("t2i")
    cond = condition_for(target)
    assert isinstance(cond, Caption)
    noisy = Caption(cond.features.clone(), cond.mask)
    noisy.features[0] += 5.0
    a = decode_chain(target, cond, [3, 8])[-1].logits
    b = decode_chain(target, noisy, [3, 8])[-1].logits
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _prefill_and_step(target: LlamaGenTarget) -> torch.Tensor:
    a = target.prefill(5, cfg=True).logits
    tokens, depths, mask, _ = random_tree(6, target.vocab_size, seed=4)
    return torch.cat([a, target.forward_tree(tokens, depths, mask).logits], dim=1)


@pytest.mark.parametrize("wrap", ["model", "ema", "module", "state_dict", "raw"])
def test_checkpoint_in_llamagen_format_loads(tmp_path, wrap: str) -> None:
    target = tiny()
    state = dict(target.state_dict())
    assert not any("cache" in k or "freqs" in k for k in state)
    state["freqs_cis"] = torch.zeros(3)  # some released files carry the derived RoPE table
    args = argparse.Namespace(gpt_model="GPT-B", gpt_type="c2i", image_size=64, downsample_size=16, cls_token_num=1)
    obj = state if wrap == "raw" else {wrap: state, "args": args, "steps": 10}
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    loaded = load_target(path, "GPT-B", **TINY)
    torch.testing.assert_close(_prefill_and_step(loaded), _prefill_and_step(target), atol=0, rtol=0)


def test_checkpoint_errors_name_the_key(tmp_path) -> None:
    state = dict(tiny().state_dict())
    missing = dict(state)
    del missing["layers.1.feed_forward.w2.weight"]
    torch.save({"model": missing}, tmp_path / "missing.pt")
    with pytest.raises(SpecimgError, match="layers.1.feed_forward.w2.weight"):
        load_target(tmp_path / "missing.pt", "GPT-B", **TINY)
    wrong = dict(state, **{"layers.0.attention.wqkv.weight": torch.zeros(3, 64)})
    torch.save({"model": wrong}, tmp_path / "wrong.pt")
    with pytest.raises(SpecimgError, match="layers.0.attention.wqkv.weight"):
        load_target(tmp_path / "wrong.pt", "GPT-B", **TINY)
    with pytest.raises(SpecimgError, match="not found"):
        load_target(tmp_path / "absent.pt", "GPT-B", **TINY)


def test_parameter_names_and_shapes_are_llamagens() -> None:
    c2i, t2i = tiny(), tiny("t2i")
    hd, ffn = 16, make_config("GPT-B", **TINY).ffn_hidden
    expected = {
        "tok_embeddings.weight": (64, 64),
        "cls_embedding.embedding_table.weight": (11, 64),  # + the null class
        "layers.0.attention.wqkv.weight": ((4 + 2 * 4) * hd, 64),
        "layers.0.attention.wo.weight": (64, 64),
        "layers.0.feed_forward.w1.weight": (ffn, 64),
        "layers.0.feed_forward.w3.weight": (ffn, 64),
        "layers.0.feed_forward.w2.weight": (64, ffn),
        "layers.0.attention_norm.weight": (64,),
        "layers.0.ffn_norm.weight": (64,),
        "norm.weight": (64,),
        "output.weight": (64, 64),
    }
    shapes = {k: tuple(v.shape) for k, v in c2i.state_dict().items()}
    assert {k: shapes[k] for k in expected} == expected
    assert len(shapes) == 4 + 7 * 2
    t2i_shapes = {k: tuple(v.shape) for k, v in t2i.state_dict().items()}
    assert t2i_shapes["cls_embedding.cap_proj.fc1.weight"] == (64, 24)
    assert t2i_shapes["cls_embedding.cap_proj.fc2.weight"] == (64, 64)
    assert t2i_shapes["cls_embedding.uncond_embedding"] == (6, 24)
    assert "cls_embedding.embedding_table.weight" not in t2i_shapes
    gqa = tiny(n_kv_head=2).state_dict()["layers.0.attention.wqkv.weight"]
    assert gqa.shape == ((4 + 2 * 2) * hd, 64)


@pytest.mark.parametrize(
    "name,n_layer,n_head,dim,ffn",
    [
        ("GPT-B", 12, 12, 768, 2048),
        ("GPT-L", 24, 16, 1024, 2816),
        ("GPT-XL", 36, 20, 1280, 3584),
        ("GPT-XXL", 48, 24, 1536, 4096),
        ("GPT-XXXL", 48, 40, 2560, 6912),
        ("GPT-1B", 22, 32, 2048, 5632),
        ("GPT-3B", 24, 32, 3200, 8704),
        ("GPT-7B", 32, 32, 4096, 11008),
    ],
)
def test_presets_match_official_dims(name: str, n_layer: int, n_head: int, dim: int, ffn: int) -> None:
    c = make_config(name)
    assert (c.n_layer, c.n_head, c.dim, c.ffn_hidden) == (n_layer, n_head, dim, ffn)
    assert (c.vocab_size, c.num_classes, c.block_size, c.cls_token_num, c.rope_base) == (16384, 1000, 256, 1, 10000.0)
    assert make_config(name, model_type="t2i").cls_token_num == 120
    assert len(PRESETS) == 8


def test_rope_table_layout() -> None:
    """Zero (cos, sin) on the condition; grid row drives the first head_dim/4 pairs, column the rest."""
    c = make_config("GPT-B", dim=32, n_head=2, block_size=16, cls_token_num=3)
    table = rope_table(c)
    assert table.shape == (3 + 16, 8, 2)
    assert table[:3].abs().max() == 0
    freqs = 10000.0 ** (-torch.arange(4) * 2 / 8)
    for cell in range(16):
        row, col = divmod(cell, 4)
        angles = torch.cat([row * freqs, col * freqs])
        torch.testing.assert_close(table[3 + cell], torch.stack([angles.cos(), angles.sin()], -1))


def test_user_errors() -> None:
    with pytest.raises(SpecimgError, match="unknown LlamaGen preset"):
        make_config("GPT-Z")
    with pytest.raises(SpecimgError, match="square"):
        make_config("GPT-B", block_size=15)
    with pytest.raises(SpecimgError, match="override"):
        make_config("GPT-B", no_such_field=1)
    with pytest.raises(SpecimgError, match="class id"):
        tiny().prefill(10, cfg=True)
    with pytest.raises(SpecimgError, match="caption"):
        tiny("t2i").prefill(Caption(torch.zeros(5, 24), torch.ones(5, dtype=torch.bool)), cfg=True)
    with pytest.raises(SpecimgError, match="null class"):
        tiny(class_dropout_prob=0.0).prefill(1, cfg=True)


def test_inference_mode_caches_and_low_precision() -> None:
    """Caches made under inference_mode are replaced outside it; bf16 weights keep a float32
    RoPE table and float32 logits close to the float32 model's."""
    target = tiny()
    with torch.inference_mode():
        ref = _prefill_and_step(target)
    torch.testing.assert_close(_prefill_and_step(target), ref, atol=0, rtol=0)
    target.to(torch.bfloat16)
    assert target.rope.dtype == torch.float32
    with pytest.raises(RuntimeError, match="prefill"):
        target.forward_tree(torch.tensor([1]), torch.tensor([0]), causal_tree_mask(1))
    low = _prefill_and_step(target)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ref, atol=0.1, rtol=0.05)


# ----------------------------------------------------------------------------- self-describing checkpoints

TINY_SHAPE = dict(n_layer=2, n_head=4, dim=64, multiple_of=32)  # the tiny_preset fixture's GPT-T


def official_args(**fields: object) -> argparse.Namespace:
    """The fields LlamaGen's train_c2i.py / train_t2i.py save under ``args`` (and more it saves but nobody reads)."""
    base = dict(gpt_model="GPT-T", gpt_type="c2i", vocab_size=64, cls_token_num=1, image_size=64, downsample_size=16,
                num_classes=10, dropout_p=0.1, lr=1e-4, results_dir="results")
    return argparse.Namespace(**{**base, **fields})


def test_checkpoint_with_args_loads_from_its_path_alone(tmp_path, tiny_preset) -> None:
    from specimg.config import Sampling
    from specimg.engine import Engine

    target = tiny()
    torch.save({"model": target.state_dict(), "args": official_args(), "steps": 1}, tmp_path / "with-args.pt")
    torch.save({"model": target.state_dict()}, tmp_path / "bare.pt")
    alone = load_target(tmp_path / "with-args.pt")
    shaped = load_target(tmp_path / "bare.pt", "GPT-B", **{**TINY, "initializer_range": 0.02})
    assert alone.config == shaped.config
    sampling = Sampling(cfg_scale=2.0, temperature=1.0)
    tokens = [Engine(t, method="ar", sampling=sampling).generate([3, 7], seed=5).tokens for t in (alone, shaped)]
    assert torch.equal(tokens[0], tokens[1])


def test_args_decide_the_grid_and_a_contradiction_names_both_values(tmp_path, tiny_preset) -> None:
    state = tiny().state_dict()  # RoPE is no weight: the same tensors serve any grid
    torch.save({"model": state}, tmp_path / "bare.pt")
    torch.save({"model": state, "args": official_args(image_size=384, downsample_size=16)}, tmp_path / "384.pt")
    assert load_target(tmp_path / "384.pt").config.block_size == 576
    with pytest.raises(SpecimgError, match=r"block_size 256 was given, but the checkpoint \(args \(image_size 384 / downsample_size 16\)\) has 576"):
        load_target(tmp_path / "384.pt", block_size=256)
    with pytest.raises(SpecimgError, match=r"preset 'GPT-B' was given, but the checkpoint \(args\) has 'GPT-T'"):
        load_target(tmp_path / "384.pt", "GPT-B", **TINY_SHAPE)
    with pytest.raises(SpecimgError, match=r"n_layer 12 was given \(by preset GPT-B\), but the checkpoint \(weights\) has 2"):
        load_target(tmp_path / "bare.pt", "GPT-B")
    torch.save({"model": state, "args": official_args(vocab_size=16384)}, tmp_path / "liar.pt")
    with pytest.raises(SpecimgError, match="vocab_size is 16384 by its args but 64 by its weights"):
        load_target(tmp_path / "liar.pt")


def test_a_forks_model_that_is_no_preset_loads_once_its_head_count_is_given(tmp_path) -> None:
    """A fork's args name its own model ("GPT-S"): the weights give width and depth, the
    head count must be given; then it loads as the same model."""
    target = tiny()
    torch.save({"model": target.state_dict(), "args": official_args(gpt_model="GPT-S")}, tmp_path / "fork.pt")
    with pytest.raises(SpecimgError, match=r"its args name the model 'GPT-S', which is no LlamaGen preset .*give its head count"):
        load_target(tmp_path / "fork.pt")
    loaded = load_target(tmp_path / "fork.pt", n_head=TINY_SHAPE["n_head"], multiple_of=TINY_SHAPE["multiple_of"], initializer_range=0.1)
    assert loaded.config == target.config
    torch.testing.assert_close(_prefill_and_step(loaded), _prefill_and_step(target), atol=0, rtol=0)


def test_released_shapes_describe_preset_and_conditioning() -> None:
    """Without args a file still says its size (width x depth is unique per preset), its
    conditioning and, for t2i, its caption width and slots; the grid only from a RoPE table."""
    from specimg.models.checkpoint import Checkpoint
    from specimg.models.llamagen import config_for, describe_checkpoint

    with torch.device("meta"):
        t2i = LlamaGenTarget(make_config("GPT-XL", model_type="t2i", block_size=1024)).state_dict()
        c2i = LlamaGenTarget(make_config("GPT-L")).state_dict()
    told = {k: v for k, (v, _) in describe_checkpoint(Checkpoint(t2i, {})).items()}
    assert told == dict(vocab_size=16384, dim=1280, n_layer=36, model_type="t2i", cls_token_num=120, caption_dim=2048)
    rope = torch.zeros(1 + 576, 32, 2)
    told = {k: v for k, (v, _) in describe_checkpoint(Checkpoint({**c2i, "freqs_cis": rope}, {})).items()}
    assert told == dict(vocab_size=16384, dim=1024, n_layer=24, model_type="c2i", block_size=576)
    assert config_for(describe_checkpoint(Checkpoint(t2i, {})), None, {}, "t2i.pt") == make_config("GPT-XL", model_type="t2i")
