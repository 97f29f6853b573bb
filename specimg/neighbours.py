"""Nearest-neighbour tables over a VQ codebook: which codes the decoder renders almost
alike, for relaxations that let close codes stand in for each other (LANTERN, LANTERN++).

A table keeps only each code's k nearest other codes ([K, k] int32, nearest first, by L2
between the vectors the decoder uses, or between the raw stored vectors as LANTERN's
released code does).  It is computed once per codebook in row chunks, so a 16384-code
book never holds its full distance matrix, and cached in memory and on disk under a hash
of the vectors' bytes and k (in :func:`specimg.cache.cache_dir`): raw and normalised
vectors are different bytes, so each has its own table.
"""

from __future__ import annotations

import hashlib
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from specimg.cache import CACHE_ENV, cache_dir
from specimg.errors import SpecimgError
from specimg.files import atomic_path

CODEBOOKS = ("normalised", "raw")
"""Which vectors neighbours are measured in: the ones the decoder sees, or the codebook as stored."""
_CHUNK_ROWS = 512
_memory: dict[tuple[str, int, str], Tensor] = {}
_by_codebook: dict[int, tuple[weakref.ref[Tensor], dict[tuple[int, str], Tensor]]] = {}
_by_target: weakref.WeakKeyDictionary[Any, dict[tuple[int, str], Tensor]] = weakref.WeakKeyDictionary()


def codebook_key(codebook: Tensor) -> str:
    """A hash of the codebook's shape and float32 bytes: the table's identity."""
    data = codebook.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(repr(tuple(data.shape)).encode())
    digest.update(data.numpy().tobytes())
    return digest.hexdigest()[:32]


def nearest_codes(codebook: Tensor, k: int, chunk_rows: int = _CHUNK_ROWS) -> Tensor:
    """[K, min(k, K-1)] int32: each code's nearest other codes by L2, nearest first.

    A row's order only needs |b|^2 - 2ab (its own |a|^2 is constant), in float64 so that
    near-duplicate codes, the ones that matter here, keep their order; one chunk of rows
    at a time, on the codebook's device.
    """
    x = codebook.detach().double()
    size = x.shape[0]
    k = min(k, size - 1)
    norms = (x * x).sum(dim=1)[None, :]
    out = torch.empty(size, k, dtype=torch.int32)
    for start in range(0, size, chunk_rows):
        rows = torch.arange(start, min(start + chunk_rows, size), device=x.device)
        key = torch.addmm(norms, x[rows], x.T, alpha=-2.0)
        key[torch.arange(rows.numel(), device=x.device), rows] = float("inf")
        out[start : start + rows.numel()] = key.topk(k, dim=1, largest=False).indices.to("cpu", torch.int32)
    return out


def neighbour_table(codebook: Tensor, k: int, device: torch.device | str | None = None) -> Tensor:
    """The cached table for ``codebook`` [K, d], on ``device`` (default: the codebook's)."""
    device = torch.device(device if device is not None else codebook.device)
    key = codebook_key(codebook)
    k = min(k, codebook.shape[0] - 1)
    if (key, k, str(device)) not in _memory:
        if (key, k, "cpu") not in _memory:
            _memory[(key, k, "cpu")] = _load_or_build(codebook, key, k)
        _memory[(key, k, str(device))] = _memory[(key, k, "cpu")].to(device)
    return _memory[(key, k, str(device))]


def _load_or_build(codebook: Tensor, key: str, k: int) -> Tensor:
    path = cache_dir() / f"neighbours-{key}-k{k}.pt"
    if path.exists():
        try:
            table = torch.load(path, weights_only=True)
            size = codebook.shape[0]
            if isinstance(table, Tensor) and table.dtype == torch.int32 and table.shape == (size, k) and bool(((table >= 0) & (table < size)).all()):
                return table
        except Exception:  # an unreadable cache entry is rebuilt, never fatal
            pass
    table = nearest_codes(codebook, k)
    try:
        with atomic_path(path, ".pt") as tmp:
            torch.save(table, tmp)
    except (OSError, RuntimeError) as err:  # torch's writer reports a read-only or full disk as a RuntimeError
        if isinstance(err, OSError):
            reason = err.strerror or str(err)
        else:  # less torch's "[enforce fail at inline_container.cc:...] . "
            reason = f"{str(err).rpartition('] . ')[2]}: a read-only or full disk?"
        warnings.warn(f"the neighbour table cannot be kept in {path.parent} ({reason}); decoding goes on without keeping it (set {CACHE_ENV} to a writable folder to keep it)", stacklevel=2)
    return table


def codebook_donors(tokenizer: Any, candidates: Tensor, k: int, vocab_size: int, method: str, raw: bool = False) -> Tensor:
    """Each candidate's k nearest codes as donors [n, C, k] (-1 where no candidate), in the
    vectors the decoder uses or, with ``raw``, in the codebook as stored."""
    if tokenizer is None:
        raise SpecimgError(f"method {method!r} needs the image tokenizer's codebook; give --tokenizer (Engine(tokenizer=...) from Python)")
    if raw and not hasattr(tokenizer, "raw_codebook_vectors"):
        raise SpecimgError(f"method {method!r} with codebook=raw needs the tokenizer's raw_codebook_vectors(), which {type(tokenizer).__name__} lacks")
    table = _tokenizer_table(tokenizer, k, candidates.device, vocab_size, method, raw)
    near = table[candidates.clamp(min=0)].long()
    return torch.where(candidates[..., None] >= 0, near, torch.full_like(near, -1))


def embedding_donors(target: Any, candidates: Tensor, k: int) -> Tensor:
    """Each candidate's k nearest tokens by cosine of the target's input embeddings as
    donors [n, C, k] (-1 where no candidate).  A target's embeddings are fixed while it
    decodes, so its table is built once per target, k and device."""
    near = _target_table(target, k, candidates.device)[candidates.clamp(min=0)].long()
    return torch.where(candidates[..., None] >= 0, near, torch.full_like(near, -1))


@torch.compiler.assume_constant_result
def _target_table(target: Any, k: int, device: torch.device) -> Tensor:
    """The neighbour table of a target's input embeddings (see :func:`_tokenizer_table`)."""
    per_target = _by_target.setdefault(target, {})
    if (k, str(device)) not in per_target:
        unit = torch.nn.functional.normalize(target.input_embeddings().float(), dim=-1)
        per_target[(k, str(device))] = neighbour_table(unit, k, device)
    return per_target[(k, str(device))]


@torch.compiler.assume_constant_result
def _tokenizer_table(tokenizer: Any, k: int, device: torch.device, vocab_size: int, method: str, raw: bool) -> Tensor:
    """The neighbour table of a tokenizer's codebook.  A tokenizer that hands out the same
    codebook tensor until it changes (as VQTokenizer does) has its table remembered, so a
    decode step neither reads nor hashes the codebook; a compiled relaxation takes the
    table as a constant of its program (the codebook does not change while it decodes)."""
    codebook = tokenizer.raw_codebook_vectors() if raw else tokenizer.codebook_vectors()
    if codebook.shape[0] != vocab_size:
        raise SpecimgError(f"the tokenizer's codebook has {codebook.shape[0]} codes, the target's vocabulary {vocab_size} tokens")
    held = _by_codebook.get(id(codebook))
    if held is None or held[0]() is not codebook:  # keyed by identity: tensors do not compare as keys
        held = _by_codebook[id(codebook)] = (weakref.ref(codebook, lambda _, key=id(codebook): _by_codebook.pop(key, None)), {})
    tables = held[1]
    if (k, str(device)) not in tables:
        tables[(k, str(device))] = neighbour_table(codebook, k, device)
    return tables[(k, str(device))]
