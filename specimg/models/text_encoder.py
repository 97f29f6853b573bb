"""Caption features for t2i targets.

A t2i target conditions on caption *features*: a :class:`TextEncoder` turns captions into
features and a validity mask, and :func:`captions_for_target` fits them to the target's
condition length the way LlamaGen does (valid tokens left-padded to ``cls_token_num``).
:func:`load_text_encoder` reads an encoder from a local path: a Hugging Face T5 folder
(``transformers``, the ``eval`` extra) or a :class:`HashTextEncoder` file (a tiny random
encoder for tests and smoke runs).  Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.models.base import Caption
from specimg.models.checkpoint import load_into


@runtime_checkable
class TextEncoder(Protocol):
    """Captions -> features for a t2i target.

    ``encode`` returns features [B, L, dim] (float) and a validity mask [B, L] (bool), valid
    tokens first (right padding, as Hugging Face tokenizers give them)."""

    dim: int

    def encode(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]: ...


_HASH_KEY = "specimg.text_encoder"


class HashTextEncoder(nn.Module):
    """A tiny deterministic encoder: each word is hashed into ``buckets`` rows of an
    embedding table, then a linear layer; at most ``max_length`` words.  Not a language
    model: it exists so that t2i plumbing can run and be tested without real weights."""

    def __init__(self, dim: int = 16, buckets: int = 257, max_length: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.dim, self.buckets, self.max_length = dim, buckets, max_length
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(buckets, dim, generator=g), requires_grad=False)
        self.proj = nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5, requires_grad=False)

    def _ids(self, text: str) -> list[int]:
        words = text.lower().split()[: self.max_length] or [""]
        return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % self.buckets for w in words]

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        ids = [self._ids(t) for t in texts]
        length = max((len(i) for i in ids), default=1)
        feats = torch.zeros(len(texts), length, self.dim)
        mask = torch.zeros(len(texts), length, dtype=torch.bool)
        for row, i in enumerate(ids):
            feats[row, : len(i)] = self.table[torch.tensor(i)] @ self.proj
            mask[row, : len(i)] = True
        return feats, mask

    def save(self, path: str | os.PathLike[str]) -> None:
        from safetensors.torch import save_file

        path = os.fspath(path)
        meta = json.dumps({"kind": "hash", "dim": self.dim, "buckets": self.buckets, "max_length": self.max_length})
        with atomic_path(path, ".safetensors") as tmp:
            save_file({"table": self.table.detach().contiguous(), "proj": self.proj.detach().contiguous()}, tmp, metadata={_HASH_KEY: meta})


_T5_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
"""A T5 folder's tokenizer: the fast one, or the SentencePiece model it is made from."""


class T5TextEncoder:
    """A Hugging Face T5 encoder from a local folder (LlamaGen's t2i models use flan-t5-xl
    features, at most 120 tokens)."""

    def __init__(self, path: str, max_length: int = 120) -> None:
        try:
            from transformers import AutoTokenizer, T5EncoderModel
        except ImportError:
            raise SpecimgError("a T5 text encoder needs transformers: pip install 'specimg[eval]'") from None
        from specimg.models.hf import first_line, load_pretrained

        if not any(os.path.isfile(os.path.join(path, name)) for name in _T5_TOKENIZER_FILES):
            raise SpecimgError(f"{path} has no tokenizer ({' or '.join(_T5_TOKENIZER_FILES)}): copy the T5 model's tokenizer files beside its weights")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, ImportError) as err:  # ImportError: a tokenizer library it needs is missing
            raise SpecimgError(f"cannot load the tokenizer in {path}: {first_line(err)}") from None
        self.model = load_pretrained(T5EncoderModel, path, unused=("lm_head.",)).eval()  # flan-t5's own LM head: a whole T5 folder
        self.dim = int(self.model.config.d_model)
        self.max_length = max_length

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        batch = self.tokenizer(list(texts), max_length=self.max_length, padding=True, truncation=True, return_tensors="pt")
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return out.float(), batch["attention_mask"].bool()


def load_text_encoder(path: str | os.PathLike[str]) -> TextEncoder:
    """A text encoder from a local path: a folder with a T5 ``config.json`` or a
    :class:`HashTextEncoder` safetensors file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from specimg.models.families import read_config

        model_type = read_config(path).get("model_type")
        if model_type != "t5":
            raise SpecimgError(f"{path} holds a {model_type!r} model, not a T5 encoder (model_type 't5')")
        return T5TextEncoder(path)
    if not os.path.isfile(path):
        raise SpecimgError(f"no text encoder at {path}")
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(_HASH_KEY, "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as err:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise SpecimgError(f"cannot read text encoder {path}: {err}") from None
    if not isinstance(meta, dict) or meta.get("kind") != "hash":
        raise SpecimgError(f"{path} is not a specimg text encoder file (no {_HASH_KEY} header)")
    sizes = {key: meta.get(key) for key in ("dim", "buckets", "max_length")}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecimgError(f"{path}: its {_HASH_KEY} header needs {key} as a positive integer, not {value!r}")
    enc = HashTextEncoder(**sizes)
    load_into(enc, tensors, origin=path)
    return enc


def captions_for_target(encoder: TextEncoder, texts: Sequence[str], length: int, dim: int, batch_size: int = 32) -> list[Caption]:
    """Encode ``texts`` and fit each to a target's condition slots: the valid tokens
    (truncated to ``length``) moved to the end and zeros with mask False in front, as
    LlamaGen left-pads its T5 features."""
    if encoder.dim != dim:
        raise SpecimgError(f"--text-encoder gives {encoder.dim}-d features, the target expects {dim}-d captions: give the encoder it was trained with")
    out = []
    for s in range(0, len(texts), batch_size):
        feats, mask = encoder.encode(texts[s : s + batch_size])
        for f, m in zip(feats, mask):
            valid = f[m.bool()][:length]
            padded = torch.zeros(length, dim, dtype=torch.float32)
            keep = torch.zeros(length, dtype=torch.bool)
            padded[length - valid.shape[0] :] = valid.float()
            keep[length - valid.shape[0] :] = True
            out.append(Caption(padded, keep))
    return out
