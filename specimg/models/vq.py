"""LlamaGen's VQ image tokenizer (VQ-16 / VQ-8), written so official checkpoints load unchanged.

Module and parameter names follow the released ``VQModel`` state dict (``encoder.conv_blocks.*``,
``decoder.mid.*``, ``quantize.embedding.weight``, ``quant_conv``, ``post_quant_conv`` ...).
Codes are row-major over the latent grid, as LlamaGen's GPT consumes them.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from attrs import validators as v
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.models.checkpoint import Checkpoint, Described, agree, load_into, read_checkpoint, settle

_METADATA_KEY = "specimg.vq_config"
_USAGE_SLOTS = 65536  # size of LlamaGen's ``quantize.codebook_used`` buffer


def int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in value)


@attrs.frozen
class VQConfig:
    """Tokenizer shape; the defaults are the released VQ-16 (ds16, 16384 x 8 codebook)."""

    codebook_size: int = attrs.field(default=16384, validator=v.ge(1))
    codebook_embed_dim: int = attrs.field(default=8, validator=v.ge(1))
    codebook_l2_norm: bool = True
    commit_loss_beta: float = attrs.field(default=0.25, validator=v.ge(0.0))
    entropy_loss_ratio: float = attrs.field(default=0.0, validator=v.ge(0.0))
    encoder_ch_mult: tuple[int, ...] = attrs.field(default=(1, 1, 2, 2, 4), converter=int_tuple)
    decoder_ch_mult: tuple[int, ...] = attrs.field(default=(1, 1, 2, 2, 4), converter=int_tuple)
    z_channels: int = attrs.field(default=256, validator=v.ge(1))
    ch: int = attrs.field(default=128, validator=v.ge(1))
    num_res_blocks: int = attrs.field(default=2, validator=v.ge(1))
    dropout: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.lt(1.0)])
    norm_groups: int = attrs.field(default=32, validator=v.ge(1))
    """GroupNorm groups (LlamaGen: 32); smaller widths need fewer."""

    def __attrs_post_init__(self) -> None:
        if not self.encoder_ch_mult or len(self.encoder_ch_mult) != len(self.decoder_ch_mult):
            raise ValueError("encoder_ch_mult and decoder_ch_mult must be non-empty and of equal length (same scale factor)")
        for mult in self.encoder_ch_mult + self.decoder_ch_mult:
            if mult < 1 or (self.ch * mult) % self.norm_groups:
                raise ValueError(f"channel width ch*{mult} = {self.ch * mult} is not a positive multiple of norm_groups={self.norm_groups}")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> VQConfig:
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as err:
            raise SpecimgError(f"invalid tokenizer config {text!r}: {err}") from None


VQ_PRESETS: dict[str, VQConfig] = {
    "VQ-16": VQConfig(),
    "VQ-8": VQConfig(encoder_ch_mult=(1, 2, 2, 4), decoder_ch_mult=(1, 2, 2, 4)),
}


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """Pre-activation residual block; a 1x1 ``nin_shortcut`` when the width changes."""

    def __init__(self, c_in: int, c_out: int, groups: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = _norm(c_in, groups)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = _norm(c_out, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head spatial self-attention with 1x1-conv q/k/v/proj_out (scale 1/sqrt(C))."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = _norm(channels, groups)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, c, hh, ww = x.shape
        h = self.norm(x)
        q, k, val = (m(h).flatten(2).transpose(1, 2).unsqueeze(1) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, val).squeeze(1).transpose(1, 2).reshape(b, c, hh, ww)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Stride-2 3x3 conv after padding right/bottom by one, as published."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour x2 then a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution: res blocks (each followed by attention where ``attn``: LlamaGen's lowest
    resolution), then an optional resampler, registered under the names of the official keys:
    ``res`` (``block`` in Chameleon's VQGAN), ``downsample``/``upsample``."""

    def __init__(self, res: list[ResnetBlock], attn: bool, groups: int, resample: tuple[str, nn.Module] | None, blocks: str = "res") -> None:
        super().__init__()
        self._blocks, self._resample = blocks, resample[0] if resample else None
        self.add_module(blocks, nn.ModuleList(res))
        self.attn = nn.ModuleList([AttnBlock(r.conv2.out_channels, groups) for r in res] if attn else [])
        if resample:
            self.add_module(*resample)

    def forward(self, h: Tensor) -> Tensor:
        for i, block in enumerate(getattr(self, self._blocks)):
            h = block(h)
            if len(self.attn):
                h = self.attn[i](h)
        return getattr(self, self._resample)(h) if self._resample else h


def mid_blocks(channels: int, groups: int, dropout: float) -> nn.ModuleList:
    """The middle of an encoder or decoder: res block, attention, res block."""
    return nn.ModuleList([ResnetBlock(channels, channels, groups, dropout), AttnBlock(channels, groups), ResnetBlock(channels, channels, groups, dropout)])


class Encoder(nn.Module):
    """Image [B,3,H,W] -> latent [B,z_channels,H/f,W/f]."""

    def __init__(self, cfg: VQConfig) -> None:
        super().__init__()
        g, mults, n = cfg.norm_groups, cfg.encoder_ch_mult, len(cfg.encoder_ch_mult)
        self.conv_in = nn.Conv2d(3, cfg.ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        c_in = cfg.ch
        for i, mult in enumerate(mults):
            c_out = cfg.ch * mult
            res = [ResnetBlock(c_in if j == 0 else c_out, c_out, g, cfg.dropout) for j in range(cfg.num_res_blocks)]
            self.conv_blocks.append(Level(res, i == n - 1, g, ("downsample", Downsample(c_out)) if i < n - 1 else None))
            c_in = c_out
        self.mid = mid_blocks(c_in, g, cfg.dropout)
        self.norm_out = _norm(c_in, g)
        self.conv_out = nn.Conv2d(c_in, cfg.z_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for module in [*self.conv_blocks, *self.mid]:
            h = module(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent [B,z_channels,h,w] -> image [B,3,h*f,w*f]; ``conv_blocks[0]`` is the lowest resolution."""

    def __init__(self, cfg: VQConfig) -> None:
        super().__init__()
        g, mults, n = cfg.norm_groups, cfg.decoder_ch_mult, len(cfg.decoder_ch_mult)
        c_in = cfg.ch * mults[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c_in, 3, padding=1)
        self.mid = mid_blocks(c_in, g, cfg.dropout)
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(n)):
            c_out = cfg.ch * mults[i]
            res = [ResnetBlock(c_in if j == 0 else c_out, c_out, g, cfg.dropout) for j in range(cfg.num_res_blocks + 1)]
            self.conv_blocks.append(Level(res, i == n - 1, g, ("upsample", Upsample(c_out)) if i > 0 else None))
            c_in = c_out
        self.norm_out = _norm(c_in, g)
        self.conv_out = nn.Conv2d(c_in, 3, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z)
        for module in [*self.mid, *self.conv_blocks]:
            h = module(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Nearest-codebook-vector quantisation (cosine when ``l2_norm``) with LlamaGen's losses.

    ``codebook_used`` is LlamaGen's training-time usage history; it is kept only so the
    state dict has the released key set and is not read here.
    """

    def __init__(self, cfg: VQConfig) -> None:
        super().__init__()
        self.l2_norm = cfg.codebook_l2_norm
        self.beta = cfg.commit_loss_beta
        self.entropy_ratio = cfg.entropy_loss_ratio
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / cfg.codebook_size, 1.0 / cfg.codebook_size)
            if self.l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, dim=-1))
        self.register_buffer("codebook_used", torch.zeros(_USAGE_SLOTS))

    def codebook(self) -> Tensor:
        w = self.embedding.weight
        return F.normalize(w, dim=-1) if self.l2_norm else w

    def forward(self, z: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """z [B,d,h,w] -> (straight-through z_q [B,d,h,w], losses, codes [B,h*w])."""
        b, _, hh, ww = z.shape
        z = z.permute(0, 2, 3, 1).reshape(b, hh * ww, -1)
        if self.l2_norm:
            z = F.normalize(z, dim=-1)
        emb = self.codebook()
        flat = z.reshape(-1, z.shape[-1])
        dist = flat.pow(2).sum(1, keepdim=True) + emb.pow(2).sum(1) - 2 * flat @ emb.t()
        codes = dist.argmin(1)
        z_q = emb[codes].view_as(z)
        losses = {
            "codebook": torch.mean((z_q - z.detach()) ** 2),
            "commitment": self.beta * torch.mean((z_q.detach() - z) ** 2),
            "entropy": self.entropy_ratio * _entropy_loss(-dist) if self.entropy_ratio > 0 else z.new_zeros(()),
        }
        z_q = z + (z_q - z).detach()
        return z_q.view(b, hh, ww, -1).permute(0, 3, 1, 2), losses, codes.view(b, hh * ww)


def _entropy_loss(affinity: Tensor, temperature: float = 0.01) -> Tensor:
    """LlamaGen's codebook entropy term: per-sample entropy minus batch-average entropy."""
    logits = affinity / temperature
    probs = logits.softmax(-1)
    avg = probs.mean(0)
    sample_entropy = -(probs * F.log_softmax(logits + 1e-5, dim=-1)).sum(-1).mean()
    return sample_entropy + (avg * torch.log(avg + 1e-5)).sum()


class VQTokenizer(nn.Module):
    """Images in [-1, 1] <-> codebook indices, with the official ``VQModel`` state-dict layout."""

    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = VectorQuantizer(config)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)
        self._codebook: dict[bool, tuple[tuple[Any, ...], Tensor]] = {}

    @property
    def downsample_factor(self) -> int:
        return self.config.downsample_factor

    @property
    def vocab_size(self) -> int:
        """Codebook size: the image-token vocabulary a target must share."""
        return self.config.codebook_size

    def _quantize(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        f = self.downsample_factor
        if images.dim() != 4 or images.shape[1] != 3 or images.shape[2] % f or images.shape[3] % f:
            raise SpecimgError(f"images must be [B,3,H,W] with H and W divisible by {f}, got {tuple(images.shape)}")
        w = self.quant_conv.weight
        return self.quantize(self.quant_conv(self.encoder(images.to(device=w.device, dtype=w.dtype))))

    @torch.no_grad()
    def encode(self, images: Tensor) -> Tensor:
        """images [B,3,H,W] in [-1,1] -> codes [B, (H/f)*(W/f)] (long, row-major)."""
        return self._quantize(images)[2]

    @torch.no_grad()
    def decode(self, codes: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """codes [B,n] -> images [B,3,h*f,w*f] in about [-1,1]; grid (h, w) defaults to square."""
        h, w = code_grid(codes, grid, self.config.codebook_size, "tokenizer codebook size")
        z_q = self.quantize.codebook()[codes.to(device=self.quant_conv.weight.device, dtype=torch.long)]
        z_q = z_q.view(codes.shape[0], h, w, -1).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(z_q))

    @torch.no_grad()
    def codebook_vectors(self) -> Tensor:
        """[K, d]: the code vectors the decoder sees (L2-normalised when the config says so).
        The same tensor until the codebook changes, so callers can remember what they
        derive from it (the neighbour tables of LANTERN's decode steps)."""
        return self._held(raw=False)

    @torch.no_grad()
    def raw_codebook_vectors(self) -> Tensor:
        """[K, d]: the codebook as stored (``quantize.embedding.weight``), before the L2
        normalisation: what LANTERN's released code takes its neighbours from.  Held like
        :meth:`codebook_vectors`."""
        return self._held(raw=True)

    def _held(self, raw: bool) -> Tensor:
        weight = self.quantize.embedding.weight
        version = (weight.data_ptr(), weight._version, weight.device, weight.dtype)
        held = self._codebook.get(raw)
        if held is None or held[0] != version:
            held = self._codebook[raw] = (version, (weight if raw else self.quantize.codebook()).detach())
        return held[1]

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Training pass: reconstruction with straight-through gradients, and the VQ losses
        (``codebook``, ``commitment`` = beta * ..., ``entropy``) as LlamaGen computes them."""
        z_q, losses, _ = self._quantize(images)
        return self.decoder(self.post_quant_conv(z_q)), losses


def code_grid(codes: Tensor, grid: tuple[int, int] | None, vocab_size: int, codebook: str) -> tuple[int, int]:
    """The grid (h, w) that codes [B, n] fill (default: square), once they are checked to lie in the codebook."""
    if codes.dim() != 2:
        raise SpecimgError(f"codes must be [B, n], got shape {tuple(codes.shape)}")
    n = codes.shape[1]
    h, w = grid if grid is not None else (math.isqrt(n), math.isqrt(n))
    if h * w != n:
        raise SpecimgError(f"{n} codes do not fill a {h}x{w} grid")
    if n and (int(codes.min()) < 0 or int(codes.max()) >= vocab_size):
        raise SpecimgError(f"codes must lie in [0, {vocab_size}) ({codebook}); vocabulary mismatch?")
    return h, w


def config_with(base: Any, overrides: dict[str, Any], what: str = "tokenizer") -> Any:
    """The attrs config ``base`` with ``overrides``; a bad one is a SpecimgError listing the options."""
    try:
        return attrs.evolve(base, **overrides)
    except (TypeError, ValueError) as err:
        fields = ", ".join(f.name for f in attrs.fields(type(base)))
        raise SpecimgError(f"bad {what} option {sorted(overrides)}: {err} (options: {fields})") from None


def build_tokenizer(config: VQConfig | None = None, *, seed: int = 0, **overrides: Any) -> VQTokenizer:
    """A freshly initialised tokenizer (eval mode) whose weights depend only on ``seed``."""
    cfg = config_with(config or VQConfig(), overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return VQTokenizer(cfg).eval()


def describe_tokenizer(checkpoint: Checkpoint, header: VQConfig | None = None, origin: str = "tokenizer") -> Described:
    """What a VQ checkpoint says about its shape: a specimg file's header, the training
    args of an official file (``vq_model``, codebook size and width, ``codebook_l2_norm``,
    loss weights), and its tensor shapes (codebook, widths, levels, so the downsampling,
    res blocks, latent channels).  GroupNorm's group count is in no shape: LlamaGen's 32
    unless the header says otherwise."""
    state, args = checkpoint.state, checkpoint.args
    told: Described = {k: (v, "header") for k, v in attrs.asdict(header).items()} if header else {}
    if isinstance(args.get("vq_model"), str):
        told["preset"] = (args["vq_model"], "args")
    for key in ("codebook_size", "codebook_embed_dim", "codebook_l2_norm", "commit_loss_beta", "entropy_loss_ratio"):
        if args.get(key) is not None:
            told[key] = (args[key], "args")
    seen: Described = {}
    if "quantize.embedding.weight" in state:
        size, width = state["quantize.embedding.weight"].shape
        seen.update(codebook_size=(int(size), "weights"), codebook_embed_dim=(int(width), "weights"))
    if "encoder.conv_in.weight" in state and "encoder.conv_out.weight" in state:
        ch = int(state["encoder.conv_in.weight"].shape[0])
        seen.update(ch=(ch, "weights"), z_channels=(int(state["encoder.conv_out.weight"].shape[0]), "weights"))
        for part in ("encoder", "decoder"):
            widths = [state.get(f"{part}.conv_blocks.{i}.res.0.conv2.weight") for i in range(len(_indices(state, f"{part}.conv_blocks.")))]
            if widths and all(w is not None and w.shape[0] % ch == 0 for w in widths):
                mults = tuple(int(w.shape[0]) // ch for w in widths)
                seen[f"{part}_ch_mult"] = (mults if part == "encoder" else mults[::-1], "weights")
        blocks = _indices(state, "encoder.conv_blocks.0.res.")
        if blocks:
            seen["num_res_blocks"] = (len(blocks), "weights")
    return agree(origin, told, seen)


def _indices(state: dict[str, Tensor], prefix: str) -> set[str]:
    """The distinct first path components after ``prefix`` (the numbered children of a ModuleList)."""
    return {k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)}


def load_tokenizer(path: str | os.PathLike[str], preset: str | None = None, **overrides: Any) -> VQTokenizer:
    """Load an official LlamaGen VQ checkpoint (``{"model"}``/``{"ema"}``/raw .pt) or a file
    written by ``save_tokenizer``.  The shape comes from the file where it says
    (:func:`describe_tokenizer`), then ``preset`` ("VQ-16", "VQ-8") and ``overrides``; a
    given value that contradicts the file is a SpecimgError naming both.  Eval mode."""
    path = os.fspath(path)
    checkpoint = read_checkpoint(path)
    header = None
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            text = (f.metadata() or {}).get(_METADATA_KEY)
        if text is not None:
            header = VQConfig.from_json(text)
    if preset is not None and preset not in VQ_PRESETS:
        raise SpecimgError(f"unknown VQ preset {preset!r}; choose one of {', '.join(VQ_PRESETS)}")
    fields = settle(describe_tokenizer(checkpoint, header, path), overrides, path, preset, attrs.asdict(VQ_PRESETS[preset]) if preset else {})
    name = fields.pop("preset", "VQ-16")
    if name not in VQ_PRESETS:
        raise SpecimgError(f"{path}: its args name the tokenizer {name!r}, which is no VQ preset ({', '.join(VQ_PRESETS)})")
    model = VQTokenizer(config_with(VQ_PRESETS[name], fields))
    state = checkpoint.state
    state.setdefault("quantize.codebook_used", model.quantize.codebook_used)  # absent from some exports
    load_into(model, state, origin=path)
    return model.eval()


def save_tokenizer(tok: VQTokenizer, path: str | os.PathLike[str]) -> None:
    """Write weights as safetensors with the config in the header, atomically."""
    from safetensors.torch import save_file

    state = {k: t.detach().contiguous().cpu() for k, t in tok.state_dict().items()}
    with atomic_path(path, ".safetensors") as tmp:
        save_file(state, tmp, metadata={_METADATA_KEY: tok.config.to_json()})
