"""Chameleon's VQGAN decoder (the image tokenizer Lumina-mGPT decodes with).

transformers ships Chameleon's VQ encoder only; this is the decoder half of the released
``vqgan.ckpt`` (a taming-transformers ``VQModel``), with its key names: ``decoder.conv_in``,
``decoder.mid.block_1`` / ``attn_1`` / ``block_2``, ``decoder.up.{level}.block.{i}`` (and
``.attn.{i}``, ``.upsample.conv``), ``decoder.norm_out``, ``decoder.conv_out``,
``post_quant_conv`` and ``quantize.embedding``.  The encoder and training-loss keys of the
file are ignored.  Codes are looked up unnormalised, as taming's ``get_codebook_entry`` does.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v
from torch import Tensor, nn

from specimg.models.checkpoint import load_into, read_checkpoint
from specimg.models.vq import Level, ResnetBlock, Upsample, code_grid, config_with, int_tuple, mid_blocks


@attrs.frozen
class ChameleonVQConfig:
    """The released ``vqgan.yaml``: 8192 codes of 256 dims, 16x downsampling, no attention
    below the middle block.  ``norm_groups`` is taming's fixed 32."""

    n_embed: int = attrs.field(default=8192, validator=v.ge(1))
    embed_dim: int = attrs.field(default=256, validator=v.ge(1))
    z_channels: int = attrs.field(default=256, validator=v.ge(1))
    ch: int = attrs.field(default=128, validator=v.ge(1))
    ch_mult: tuple[int, ...] = attrs.field(default=(1, 1, 2, 2, 4), converter=int_tuple)
    num_res_blocks: int = attrs.field(default=2, validator=v.ge(1))
    attn_resolutions: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)
    resolution: int = attrs.field(default=512, validator=v.ge(1))
    out_ch: int = attrs.field(default=3, validator=v.ge(1))
    norm_groups: int = attrs.field(default=32, validator=v.ge(1))


class _Decoder(nn.Module):
    def __init__(self, c: ChameleonVQConfig) -> None:
        super().__init__()
        levels = len(c.ch_mult)
        block_in = c.ch * c.ch_mult[-1]
        res = c.resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(c.z_channels, block_in, 3, padding=1)
        self.mid = nn.Sequential(OrderedDict(zip(("block_1", "attn_1", "block_2"), mid_blocks(block_in, c.norm_groups, 0.0))))  # taming's names
        ups: list[Level] = []
        for level in reversed(range(levels)):
            out = c.ch * c.ch_mult[level]
            blocks = [ResnetBlock(block_in if i == 0 else out, out, c.norm_groups, 0.0) for i in range(c.num_res_blocks + 1)]
            ups.insert(0, Level(blocks, res in c.attn_resolutions, c.norm_groups, ("upsample", Upsample(out)) if level else None, "block"))
            block_in = out
            res = res * 2 if level != 0 else res
        self.up = nn.ModuleList(ups)
        self.norm_out = nn.GroupNorm(c.norm_groups, block_in, eps=1e-6)
        self.conv_out = nn.Conv2d(block_in, c.out_ch, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for up in reversed(self.up):
            h = up(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class ChameleonVQDecoder(nn.Module):
    """Codes -> images, with specimg's tokenizer interface (``decode``, ``codebook_vectors``)."""

    def __init__(self, config: ChameleonVQConfig) -> None:
        super().__init__()
        self.config = config
        self.quantize = nn.ModuleDict({"embedding": nn.Embedding(config.n_embed, config.embed_dim)})  # the file's quantize.embedding
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.z_channels, 1)
        self.decoder = _Decoder(config)

    @property
    def vocab_size(self) -> int:
        return self.config.n_embed

    @torch.no_grad()
    def decode(self, codes: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """codes [B, n] (row-major) -> images [B, 3, 16h, 16w] in about [-1, 1]; grid (h, w)
        defaults to square."""
        h, w = code_grid(codes, grid, self.vocab_size, "the VQGAN codebook")
        weight = self.post_quant_conv.weight
        z = self.quantize.embedding(codes.to(weight.device, torch.long)).view(codes.shape[0], h, w, -1)
        return self.decoder(self.post_quant_conv(z.permute(0, 3, 1, 2).to(weight.dtype)))

    @torch.no_grad()
    def codebook_vectors(self) -> Tensor:
        """[K, d]: the code vectors the decoder sees: the codebook as stored, not normalised."""
        return self.quantize.embedding.weight.detach()

    raw_codebook_vectors = codebook_vectors  # the same vectors: the decoder does not normalise them


_KEPT_PREFIXES = ("decoder.", "post_quant_conv.", "quantize.embedding.")


def load_chameleon_vq_decoder(path: str | os.PathLike[str], **overrides: Any) -> ChameleonVQDecoder:
    """Load the decoder half of a released Chameleon ``vqgan.ckpt`` (``{"state_dict": ...}``)
    or of any file with its key names; ``overrides`` adjust :class:`ChameleonVQConfig`."""
    config = config_with(ChameleonVQConfig(), overrides, "VQGAN")
    state = {k: t for k, t in read_checkpoint(path).state.items() if k.startswith(_KEPT_PREFIXES)}
    model = ChameleonVQDecoder(config)
    load_into(model, state, origin=os.fspath(path))
    return model.eval()
