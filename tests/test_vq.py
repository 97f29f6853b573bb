"""VQ tokenizer: shapes, quantisation, official checkpoint layouts, own file format."""

from __future__ import annotations

import argparse
import os

import attrs
import pytest
import torch
import torch.nn.functional as F

from specimg.errors import SpecimgError
from specimg.models.vq import VQ_PRESETS, VQConfig, VQTokenizer, build_tokenizer, load_tokenizer, save_tokenizer

TINY = dict(ch=16, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2), num_res_blocks=1, z_channels=16,
            codebook_size=64, codebook_embed_dim=4, norm_groups=8)


@pytest.fixture(scope="module")
def tok() -> VQTokenizer:
    return build_tokenizer(seed=3, **TINY)


def images(b: int = 2, size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_encode_decode_shapes(tok: VQTokenizer) -> None:
    assert tok.downsample_factor == 2
    codes = tok.encode(images())
    assert codes.shape == (2, 64) and codes.dtype == torch.long
    assert 0 <= int(codes.min()) and int(codes.max()) < 64
    assert tok.decode(codes).shape == (2, 3, 16, 16)
    assert tok.decode(codes[:, :32], grid=(4, 8)).shape == (2, 3, 8, 16)


def test_quantizer_maps_each_codebook_vector_to_its_own_index(tok: VQTokenizer) -> None:
    vectors = tok.codebook_vectors()
    scale = torch.rand(64, 1) + 0.5  # L2 normalisation makes the scale irrelevant
    _, _, codes = tok.quantize(tok.quantize.embedding.weight.detach().mul(scale)[:, :, None, None])
    assert torch.equal(codes.flatten(), torch.arange(64))
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(64))


@pytest.mark.parametrize("l2", [True, False])
def test_codes_are_nearest_codebook_vectors_row_major(l2: bool) -> None:
    tok = build_tokenizer(codebook_l2_norm=l2, **TINY)
    x = images(seed=1)
    with torch.no_grad():
        z = tok.quant_conv(tok.encoder(x)).permute(0, 2, 3, 1).reshape(2, 64, 4)
    z = F.normalize(z, dim=-1) if l2 else z
    expected = torch.cdist(z, tok.codebook_vectors()[None]).argmin(-1)
    assert torch.equal(tok.encode(x), expected)


def test_raw_codebook_is_the_stored_weight_held_until_it_changes() -> None:
    tok = build_tokenizer(seed=4, **TINY)
    with torch.no_grad():
        tok.quantize.embedding.weight.mul_(torch.rand(64, 1) + 0.5)  # rows of unequal norm
    raw, normalised = tok.raw_codebook_vectors(), tok.codebook_vectors()
    assert torch.equal(raw, tok.quantize.embedding.weight) and not torch.allclose(raw, normalised)
    assert torch.allclose(normalised, F.normalize(raw, dim=-1))
    assert tok.raw_codebook_vectors() is raw and tok.codebook_vectors() is normalised
    with torch.no_grad():
        tok.quantize.embedding.weight.mul_(2.0)
    assert tok.raw_codebook_vectors() is not raw and tok.codebook_vectors() is not normalised


def test_decode_reads_the_codebook_vectors(tok: VQTokenizer) -> None:
    codes = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(2))
    z_q = tok.codebook_vectors()[codes].view(1, 8, 8, 4).permute(0, 3, 1, 2)
    with torch.no_grad():
        expected = tok.decoder(tok.post_quant_conv(z_q))
    assert torch.allclose(tok.decode(codes), expected)


def test_decode_rejects_bad_codes(tok: VQTokenizer) -> None:
    with pytest.raises(SpecimgError, match="codebook size"):
        tok.decode(torch.full((1, 64), 64))
    with pytest.raises(SpecimgError, match="grid"):
        tok.decode(torch.zeros(1, 60, dtype=torch.long))
    with pytest.raises(SpecimgError, match="divisible"):
        tok.encode(torch.zeros(1, 3, 15, 16))


def test_training_forward_losses_and_straight_through_gradients() -> None:
    tok = build_tokenizer(**TINY).train()
    recon, losses = tok(images())
    assert recon.shape == (2, 3, 16, 16)
    assert set(losses) == {"codebook", "commitment", "entropy"}
    assert torch.allclose(losses["commitment"], 0.25 * losses["codebook"])
    assert float(losses["entropy"]) == 0.0
    (F.mse_loss(recon, images()) + sum(losses.values())).backward()
    assert tok.encoder.conv_in.weight.grad is not None and tok.encoder.conv_in.weight.grad.abs().sum() > 0
    assert tok.quantize.embedding.weight.grad is not None
    entropy = build_tokenizer(entropy_loss_ratio=0.1, **TINY).train()(images())[1]["entropy"]
    assert entropy.requires_grad and float(entropy.detach()) != 0.0


def test_build_is_seeded_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = build_tokenizer(seed=5, **TINY), build_tokenizer(seed=5, **TINY)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    assert not torch.equal(build_tokenizer(seed=6, **TINY).encoder.conv_in.weight, a.encoder.conv_in.weight)


@pytest.mark.parametrize("wrapper", ["model", "ema", None])
def test_llamagen_checkpoint_loads_and_decodes_identically(tok: VQTokenizer, tmp_path, wrapper: str | None) -> None:
    sd = tok.state_dict()
    args = argparse.Namespace(vq_model="VQ-16", codebook_size=64, codebook_embed_dim=4)
    p = tmp_path / "vq.pt"
    torch.save(sd if wrapper is None else {wrapper: sd, "args": args}, p)
    loaded = load_tokenizer(p, **TINY)
    codes = tok.encode(images())
    assert torch.equal(loaded.encode(images()), codes)
    assert torch.equal(loaded.decode(codes), tok.decode(codes))


def test_checkpoint_without_usage_buffer_loads_its_weights(tok: VQTokenizer, tmp_path) -> None:
    sd = {k: v for k, v in tok.state_dict().items() if k != "quantize.codebook_used"}
    torch.save({"ema": sd}, tmp_path / "vq.pt")
    loaded = load_tokenizer(tmp_path / "vq.pt", **TINY)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items())
    assert not loaded.quantize.codebook_used.any()
    codes = tok.encode(images())
    assert torch.equal(loaded.encode(images()), codes) and torch.equal(loaded.decode(codes), tok.decode(codes))


def test_missing_or_misshapen_key_is_named(tok: VQTokenizer, tmp_path) -> None:
    sd = dict(tok.state_dict())
    del sd["decoder.conv_out.bias"]
    torch.save({"model": sd}, tmp_path / "missing.pt")
    with pytest.raises(SpecimgError, match="decoder.conv_out.bias"):
        load_tokenizer(tmp_path / "missing.pt", **TINY)
    sd = dict(tok.state_dict(), **{"decoder.conv_out.weight": torch.zeros(3, 8, 3, 3)})
    torch.save({"model": sd}, tmp_path / "shape.pt")
    with pytest.raises(SpecimgError, match="decoder.conv_out.weight"):
        load_tokenizer(tmp_path / "shape.pt", **TINY)


def test_save_load_roundtrip_needs_no_overrides(tok: VQTokenizer, tmp_path) -> None:
    p = tmp_path / "out" / "tok.safetensors"
    save_tokenizer(tok, p)
    assert os.listdir(p.parent) == ["tok.safetensors"]
    loaded = load_tokenizer(p)
    assert loaded.config == tok.config and not loaded.training
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in tok.state_dict().items())
    with pytest.raises(SpecimgError, match=r"codebook_size 32 was given, but the checkpoint \(header\) has 64"):
        load_tokenizer(p, codebook_size=32)


def test_bad_options_are_user_errors() -> None:
    with pytest.raises(SpecimgError, match="options"):
        build_tokenizer(**TINY, codebok_size=3)
    with pytest.raises(SpecimgError, match="norm_groups"):
        build_tokenizer(ch=16)
    assert VQConfig.from_json(VQConfig(**TINY).to_json()) == VQConfig(**TINY)


def test_vq16_defaults_match_the_released_model() -> None:
    """Shapes from LlamaGen's tokenizer/tokenizer_image/vq_model.py (VQ_16, ModelArgs defaults):
    343 parameter tensors (~72M weights) plus the ``quantize.codebook_used`` [65536] buffer."""
    with torch.device("meta"):
        model = VQTokenizer(VQConfig())
    params = dict(model.named_parameters())
    assert len(params) == 343 and sum(p.numel() for p in params.values()) == 71_883_403
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    assert len(shapes) == 344 and shapes["quantize.codebook_used"] == (65536,)
    expected = {
        "encoder.conv_in.weight": (128, 3, 3, 3),
        "encoder.conv_blocks.2.res.0.nin_shortcut.weight": (256, 128, 1, 1),
        "encoder.conv_blocks.3.downsample.conv.weight": (256, 256, 3, 3),
        "encoder.conv_blocks.4.attn.1.q.weight": (512, 512, 1, 1),
        "encoder.mid.1.proj_out.weight": (512, 512, 1, 1),
        "encoder.conv_out.weight": (256, 512, 3, 3),
        "quant_conv.weight": (8, 256, 1, 1),
        "quantize.embedding.weight": (16384, 8),
        "post_quant_conv.weight": (256, 8, 1, 1),
        "decoder.conv_in.weight": (512, 256, 3, 3),
        "decoder.conv_blocks.0.attn.2.proj_out.weight": (512, 512, 1, 1),
        "decoder.conv_blocks.0.upsample.conv.weight": (512, 512, 3, 3),
        "decoder.conv_blocks.1.res.0.nin_shortcut.weight": (256, 512, 1, 1),
        "decoder.conv_blocks.4.res.2.conv2.weight": (128, 128, 3, 3),
        "decoder.conv_out.weight": (3, 128, 3, 3),
    }
    assert {k: shapes[k] for k in expected} == expected
    assert "decoder.conv_blocks.4.upsample.conv.weight" not in shapes
    assert model.downsample_factor == 16 and VQ_PRESETS["VQ-8"].downsample_factor == 8


@pytest.mark.parametrize("name", ["VQ-16", "VQ-8"])
def test_released_shapes_describe_their_preset(name: str) -> None:
    from specimg.models.checkpoint import Checkpoint
    from specimg.models.vq import describe_tokenizer

    with torch.device("meta"):
        state = VQTokenizer(VQ_PRESETS[name]).state_dict()
    told = {k: v for k, (v, _) in describe_tokenizer(Checkpoint(state, {})).items()}
    preset = attrs.asdict(VQ_PRESETS[name])
    assert told == {k: preset[k] for k in ("codebook_size", "codebook_embed_dim", "ch", "z_channels", "encoder_ch_mult", "decoder_ch_mult", "num_res_blocks")}
    assert VQConfig(**{**attrs.asdict(VQConfig()), **told}).downsample_factor == {"VQ-16": 16, "VQ-8": 8}[name]


def test_official_file_needs_only_what_no_shape_holds(tok: VQTokenizer, tmp_path) -> None:
    """Everything but GroupNorm's groups comes from the file (LlamaGen always uses 32; the
    tiny test model uses 8); a contradicting preset or value names both sides."""
    torch.save({"model": tok.state_dict(), "args": argparse.Namespace(vq_model="VQ-16", codebook_size=64)}, tmp_path / "vq.pt")
    loaded = load_tokenizer(tmp_path / "vq.pt", norm_groups=8)
    assert loaded.config == tok.config
    with pytest.raises(SpecimgError, match=r"preset 'VQ-8' was given, but the checkpoint \(args\) has 'VQ-16'"):
        load_tokenizer(tmp_path / "vq.pt", preset="VQ-8", norm_groups=8)
    torch.save({"model": tok.state_dict(), "args": argparse.Namespace(codebook_size=128)}, tmp_path / "liar.pt")
    with pytest.raises(SpecimgError, match="codebook_size is 128 by its args but 64 by its weights"):
        load_tokenizer(tmp_path / "liar.pt", norm_groups=8)
