"""Where a benchmark's conditions come from: class labels for c2i targets, captions for t2i.

Caption files are read from local paths, in four formats (chosen by the file name):

- ``*.txt`` (or anything not listed below): one caption per non-empty line;
- ``*.jsonl``: one JSON value per line, a string or an object with a ``caption``,
  ``prompt`` or ``text`` field (other fields are kept as metadata);
- ``*.json``: the COCO captions annotations format (``captions_train2017.json``,
  ``captions_val2014.json``...): ``{"images": [...], "annotations": [{"image_id", "id",
  "caption"}, ...]}``; one caption per image (the one with the lowest annotation id), in
  image-id order, as FID-on-COCO evaluations use;
- ``*.tsv``: PartiPrompts (``PartiPrompts.tsv``: columns Prompt, Category, Challenge, Note).

A t2i target needs caption *features*: a :class:`TextEncoder` turns captions into
features and a validity mask, and :func:`captions_for_target` fits them to the target's
condition length the way LlamaGen does (valid tokens left-padded to ``cls_token_num``).
:func:`load_text_encoder` reads an encoder from a local path: a Hugging Face T5 folder
(``transformers``, the ``eval`` extra) or a :class:`HashTextEncoder` file (a tiny random
encoder for tests and smoke runs).  Nothing is downloaded.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor, nn

from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.models.base import Caption

_TEXT_KEYS = ("caption", "prompt", "text")
PARTI_COLUMNS = ("Prompt", "Category", "Challenge", "Note")


@attrs.frozen
class Prompt:
    """One caption and where it came from (``meta``: the file's other fields)."""

    text: str
    meta: dict[str, Any] = attrs.field(factory=dict, eq=False)


# ----------------------------------------------------------------------------- class labels


def class_labels(text: str | None, num_images: int, num_classes: int) -> list[int]:
    """``"3,5"`` -> labels for ``num_images`` images, cycled (3, 5, 3, 5...); none given:
    0, 1, 2, ... cycled over the classes.  Label i never depends on ``num_images``."""
    if not text:
        return [i % num_classes for i in range(num_images)]
    try:
        labels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecimgError(f"--class-labels takes comma-separated integers, not {text!r}") from None
    if not labels:
        raise SpecimgError("--class-labels names no class")
    bad = [x for x in labels if not 0 <= x < num_classes]
    if bad:
        raise SpecimgError(f"class label {bad[0]} is outside [0, {num_classes})")
    return [labels[i % len(labels)] for i in range(num_images)]


# ----------------------------------------------------------------------------- caption files


def read_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    """All captions of a caption file (format by file name, see the module doc)."""
    path = os.fspath(path)
    name = os.path.basename(path).lower()
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as err:
        raise SpecimgError(f"cannot read prompt file {path}: {err}") from None
    if name.endswith(".tsv"):
        prompts = _parti(text, path)
    elif name.endswith(".jsonl"):
        prompts = _jsonl(text, path)
    elif name.endswith(".json"):
        prompts = _coco(text, path)
    else:
        prompts = [Prompt(line.strip(), {"line": i}) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts:
        raise SpecimgError(f"prompt file {path} holds no caption")
    return prompts


def _jsonl(text: str, path: str) -> list[Prompt]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            raise SpecimgError(f"{path}: line {number} is not JSON") from None
        if isinstance(value, str):
            out.append(Prompt(value, {"line": number}))
            continue
        key = next((k for k in _TEXT_KEYS if isinstance(value, dict) and isinstance(value.get(k), str)), None)
        if key is None:
            raise SpecimgError(f"{path}: line {number} has no string field {' / '.join(_TEXT_KEYS)}")
        out.append(Prompt(value[key], {k: v for k, v in value.items() if k != key}))
    return out


def _coco(text: str, path: str) -> list[Prompt]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecimgError(f"{path} is not JSON: {err}") from None
    notes = data.get("annotations") if isinstance(data, dict) else None
    if not isinstance(notes, list):
        raise SpecimgError(f"{path} is not a COCO captions file (no 'annotations' list)")
    first: dict[Any, dict[str, Any]] = {}
    try:
        for note in notes:
            image, caption = note["image_id"], note["caption"]
            if not isinstance(caption, str):
                raise TypeError
            if image not in first or note.get("id", 0) < first[image].get("id", 0):
                first[image] = note
    except (KeyError, TypeError):
        raise SpecimgError(f"{path}: every COCO annotation needs an image_id and a caption string") from None
    files = {im.get("id"): im.get("file_name") for im in data.get("images", []) if isinstance(im, dict)}
    return [
        Prompt(first[i]["caption"].strip(), {"image_id": i, "id": first[i].get("id"), "file_name": files.get(i)})
        for i in sorted(first, key=lambda k: (str(type(k)), k))
    ]


def _parti(text: str, path: str) -> list[Prompt]:
    rows = list(csv.reader(text.splitlines(), delimiter="\t"))
    if not rows or rows[0][: len(PARTI_COLUMNS)] != list(PARTI_COLUMNS):
        raise SpecimgError(f"{path} is not PartiPrompts.tsv (header {'/'.join(PARTI_COLUMNS)} expected)")
    header = rows[0]
    out = []
    for number, row in enumerate(rows[1:], 2):
        if not any(cell.strip() for cell in row):
            continue
        fields = dict(zip(header, row + [""] * (len(header) - len(row))))
        if not fields["Prompt"].strip():
            raise SpecimgError(f"{path}: line {number} has an empty Prompt")
        out.append(Prompt(fields.pop("Prompt").strip(), {k.lower(): v for k, v in fields.items()}))
    return out


def select_prompts(prompts: Sequence[Prompt], num: int, category: str | None = None) -> list[Prompt]:
    """The first ``num`` prompts (of ``category`` when given, matched against a ``category``
    field case-insensitively), cycled when the file holds fewer."""
    if category is not None:
        prompts = [p for p in prompts if str(p.meta.get("category", "")).lower() == category.lower()]
        if not prompts:
            raise SpecimgError(f"no prompt of category {category!r}")
    return [prompts[i % len(prompts)] for i in range(num)]


# ----------------------------------------------------------------------------- text encoders


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


class T5TextEncoder:
    """A Hugging Face T5 encoder from a local folder (LlamaGen's t2i models use flan-t5-xl
    features, at most 120 tokens)."""

    def __init__(self, path: str, max_length: int = 120) -> None:
        try:
            from transformers import AutoTokenizer, T5EncoderModel
        except ImportError:
            raise SpecimgError("a T5 text encoder needs transformers: pip install 'specimg[eval]'") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = T5EncoderModel.from_pretrained(path, local_files_only=True).eval()
        except (OSError, ValueError) as err:
            raise SpecimgError(f"cannot load a T5 encoder from {path}: {err}") from None
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
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SpecimgError(f"{path} is not a Hugging Face model folder (no config.json)")
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
    enc = HashTextEncoder(meta["dim"], meta["buckets"], meta["max_length"])
    enc.table.data.copy_(tensors["table"])
    enc.proj.data.copy_(tensors["proj"])
    return enc


def captions_for_target(encoder: TextEncoder, texts: Sequence[str], length: int, dim: int, batch_size: int = 32) -> list[Caption]:
    """Encode ``texts`` and fit each to a target's condition slots: the valid tokens
    (truncated to ``length``) moved to the end and zeros with mask False in front, as
    LlamaGen left-pads its T5 features."""
    if encoder.dim != dim:
        raise SpecimgError(f"the text encoder gives {encoder.dim}-d features, the target expects {dim}-d captions")
    out = []
    for s in range(0, len(texts), batch_size):
        feats, mask = encoder.encode(texts[s : s + batch_size])
        for f, m in zip(feats, mask):
            valid = f[m.bool()][:length]
            padded = torch.zeros(length, dim, dtype=torch.float32)
            keep = torch.zeros(length, dtype=torch.bool)
            if valid.shape[0]:
                padded[length - valid.shape[0] :] = valid.float()
                keep[length - valid.shape[0] :] = True
            out.append(Caption(padded, keep))
    return out
