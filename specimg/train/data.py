"""Drafter training data: the target's teacher-forced features, generated once, stored as shards.

An *example* is one image's token sequence ``tokens`` [N] (N = the target's image tokens),
its condition ``label`` and the target's last hidden states ``features`` [N, D] after the
final norm, teacher-forced on those tokens: ``features[t]`` is the state at the position
before ``tokens[t]`` (``forward_sequence``'s convention), so ``output(features[t])`` are the
target's logits for ``tokens[t]``.  The target's distributions are not stored: the output
head is frozen and shared with the drafter, so the trainer recomputes them exactly from
the features, as EAGLE does (a [N, V] float table per image would be ~V/D times larger).

Token sequences come from

- a tokens file (a dataset tokenised with the VQ): safetensors with ``tokens`` [M, N]
  (integers) and optionally ``labels`` [M]; or
- self-distillation: sampled from the target itself with its own sampling settings
  (CFG, temperature, top-k, top-p), as EAGLE and LANTERN do.  Sample i uses seed
  ``seed + i``, so the samples do not depend on the batch size or the number of
  processes, and equal ``Engine(method="ar").generate([condition], seed=seed + i)``.

A c2i target's samples are conditioned on class labels (``label`` = the class); a t2i
target's on captions, one per sample, made from prompts by the caller's text encoder
(``label`` = the sample's index in ``settings.prompts``; the captions' digest is part of the
settings, so a folder is never finished with another encoder's features).  A target that
tokenizes prompt texts itself (Janus, Lumina-mGPT: any :class:`~specimg.models.eagle.EagleTarget`
with ``prompt_ids``) takes the prompts as they are, texts or token ids; it is sampled by the engine's AR loop
and teacher-forced through the Target contract (:func:`chain_features`).

EAGLE-3 data (``drafter_type`` "eagle3") also stores ``layers`` [N, kD]: the inputs of the
target's EAGLE-3 layers (:func:`~specimg.models.eagle3.eagle3_layers`, recorded in the
settings) at the same positions, the drafter's input; ``features`` still give the target's
distributions.

With ``uncond`` (the default when the target has a null condition) every sequence is also
teacher-forced under the null condition and stored as a second example with ``label =
num_classes`` (c2i) or ``-1`` (t2i: LlamaGen's ``uncond_embedding`` with the sample's
caption mask, or the target's own unconditional row): under CFG the drafter drafts the
unconditional row too.

Layout of a data folder::

    meta.json                   format, settings, counts, the target's fingerprint
    shard-00000.safetensors     features [n, N, D], tokens [n, N], labels [n], sample [n] (and layers [n, N, kD])
    ...

Shard k holds samples [k * shard_size, (k + 1) * shard_size) and is written atomically,
so a killed run started again with the same settings only makes the missing shards;
several processes (``accelerate launch``) share the shards round-robin.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from specimg.config import Sampling
from specimg.engine import ar_tokens
from specimg.errors import SpecimgError
from specimg.files import atomic_path
from specimg.models.base import Caption, causal_tree_mask, takes_text
from specimg.models.eagle import DRAFTER_TYPES, EagleTarget
from specimg.models.eagle3 import eagle3_layers
from specimg.models.llamagen import LlamaGenTarget
from specimg.runs.folder import file_digest

FORMAT = "specimg-drafter-data/1"
META = "meta.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def target_fingerprint(target: EagleTarget) -> dict[str, Any]:
    """The target's shape and a hash of its output head (a LlamaGen target) or of its image
    tokens' input embeddings (others), rounded to bfloat16 (so an fp32 and a bf16 copy of
    one checkpoint agree): data made with one target is refused by a drafter trained
    against another."""
    if isinstance(target, LlamaGenTarget):
        config, weights = attrs.asdict(target.config), target.output.weight
    else:
        config = {"family": type(target).__name__, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "num_tokens": target.num_tokens}
        weights = target.input_embeddings()
    head = weights.detach().to("cpu", torch.bfloat16).view(torch.int16)
    digest = hashlib.sha256(head.numpy().tobytes()).hexdigest()[:16]
    return {"config": config, "head_sha256": digest}


def _atomic_write_json(path: str, obj: Any) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _read_json(path: str) -> Any:
    """``path``'s JSON, None when there is no such file; one that cannot be read is one line."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise SpecimgError(f"cannot read {path}: {err}") from None


# ----------------------------------------------------------------------------- sources


@torch.inference_mode()
def chain_features(target: EagleTarget, conditions: Sequence[Any], tokens: Tensor, cfg: bool) -> tuple[Tensor, Tensor | None]:
    """Any target's last hidden states [rows, B, N, D] teacher-forced on ``tokens`` [B, N],
    one condition per image, through the Target contract: the prefill's state, then the
    states of the first N - 1 tokens verified as one chain; and its exposed layers' [rows,
    B, N, kD] alike (None when it exposes none).  With ``cfg`` row 1 holds the target's
    unconditional row."""
    n = tokens.shape[1]
    hidden, layers = [], []
    for condition, seq in zip(conditions, tokens):
        first = target.prefill(condition, cfg)
        rest = target.forward_tree(seq[:-1], torch.arange(n - 1), causal_tree_mask(n - 1))
        hidden.append(torch.cat([first.hidden, rest.hidden], dim=1))
        if first.layers is not None:
            layers.append(torch.cat([first.layers, rest.layers], dim=1))
    return torch.stack(hidden, dim=1), torch.stack(layers, dim=1) if layers else None


def read_tokens_file(path: str | os.PathLike[str], target: LlamaGenTarget) -> tuple[Tensor, Tensor | None]:
    """A tokenised dataset: safetensors with ``tokens`` [M, N] and optionally ``labels`` [M]."""
    from safetensors.torch import load_file

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SpecimgError(f"tokens file not found: {path}")
    try:
        data = load_file(path)
    except Exception as err:
        raise SpecimgError(f"cannot read tokens file {path} (safetensors with 'tokens' [M, N] and 'labels' [M]): {err}") from None
    c = target.config
    tokens, labels = data.get("tokens"), data.get("labels")
    if tokens is None:
        raise SpecimgError(f"{path} has no 'tokens' tensor (found: {', '.join(data) or 'nothing'})")
    if tokens.dim() != 2 or tokens.shape[1] != c.block_size or tokens.is_floating_point():
        raise SpecimgError(f"{path}: 'tokens' must be integers [M, {c.block_size}] for this target, got {tuple(tokens.shape)} {tokens.dtype}")
    tokens = tokens.long()
    if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < c.vocab_size):
        raise SpecimgError(f"{path}: tokens outside the target's vocabulary [0, {c.vocab_size})")
    if labels is not None:
        if labels.shape != (tokens.shape[0],) or labels.is_floating_point():
            raise SpecimgError(f"{path}: 'labels' must be integers [{tokens.shape[0]}], got {tuple(labels.shape)} {labels.dtype}")
        labels = labels.long()
        if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < c.num_classes):
            raise SpecimgError(f"{path}: labels outside [0, {c.num_classes})")
    return tokens, labels


def _captions_digest(captions: Sequence[Caption]) -> str:
    """A digest of caption features and masks; features rounded to bfloat16, so that float
    noise between two runs of one text encoder does not count as other captions."""
    h = hashlib.sha256()
    for caption in captions:
        h.update(caption.features.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
        h.update(caption.mask.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- writing


@attrs.frozen
class DataSpec:
    """What to generate.  ``tokens_file`` None means self-distillation with ``sampling``;
    ``labels`` are cycled over the samples (default 0, 1, 2, ... mod num_classes; a tokens
    file's own labels win).  A LlamaGen t2i target takes ``captions`` instead, one per
    sample, and the ``prompts`` they were made from; a target that tokenizes texts itself
    takes the ``prompts`` alone (texts, or whole prompts as token ids)."""

    num_samples: int | None = None
    labels: tuple[int, ...] = ()
    captions: tuple[Caption, ...] = ()
    prompts: tuple[str | Sequence[int], ...] = ()
    tokens_file: str | None = None
    sampling: Sampling = Sampling(cfg_scale=4.0)
    seed: int = 0
    uncond: bool | None = None
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(tuple(DTYPES)))
    shard_size: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    batch_size: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    drafter_type: str = attrs.field(default="eagle1", validator=attrs.validators.in_(DRAFTER_TYPES))


@attrs.frozen
class _Plan:
    """What a run makes, resolved once from the spec and the target, so that generating a
    shard needs nothing else: the target's kind ("c2i", "t2i", or "text" for one that
    tokenizes prompt texts itself), each sample's label, whether it also gets a null-condition
    example, and a tokens file's sequences (None: self-distilled)."""

    spec: DataSpec
    kind: str
    num: int
    labels: Tensor
    uncond: bool
    file_tokens: Tensor | None

    @property
    def eagle3(self) -> bool:
        return self.spec.drafter_type == "eagle3"

    @property
    def num_shards(self) -> int:
        return -(-self.num // self.spec.shard_size)

    def seeds(self, idx: Tensor) -> list[int]:
        """Sample i's seed is ``seed + i``: samples do not depend on the batch size or the process count."""
        return [self.spec.seed + int(i) for i in idx]

    def shard_samples(self, shard: int) -> tuple[int, int]:
        """The samples [lo, hi) of shard ``shard``."""
        size = self.spec.shard_size
        return shard * size, min(self.num, (shard + 1) * size)


def make_drafter_data(
    target: EagleTarget,
    out: str | os.PathLike[str],
    spec: DataSpec,
    *,
    process_index: int = 0,
    num_processes: int = 1,
    barrier: Callable[[], None] = lambda: None,
    progress: Callable[[int], None] | None = None,
    progress_total: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Generate (or finish generating) a data folder; returns its meta.  With several
    processes, call it in each with its index, the count and a barrier: the shards are
    shared round-robin.  ``progress`` is called with the samples each batch finished (a
    resumed run's finished shards count at once); ``progress_total`` first, once, with the
    samples of this process's shards, all those calls add up to (the number is known only
    once a tokens file is read)."""
    out = os.fspath(out)
    kind = _target_kind(target)
    source, num, file_tokens, file_labels = _source(target, spec, kind)
    labels = _labels(target, spec, kind, num, file_labels)
    plan = _Plan(spec, kind, num, labels, _with_null_examples(target, spec, kind), file_tokens)
    layers = list(eagle3_layers(target.num_layers)) if plan.eagle3 else None
    if layers is not None:  # the target outputs its EAGLE-3 layers' inputs, an EAGLE-3 drafter's input
        target.expose_layers(layers)
    meta = {  # the settings and the target's fingerprint (what a resumed run must match), and the sizes a reader needs
        "format": FORMAT, "settings": _settings(plan, source, layers), "target": target_fingerprint(target), "num_shards": plan.num_shards,
        "num_examples": plan.num * (1 + plan.uncond), "num_tokens": target.num_tokens, "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "num_classes": target.config.num_classes if isinstance(target, LlamaGenTarget) else None,
    }
    _open_folder(out, meta, process_index, barrier)
    shards = range(process_index, plan.num_shards, num_processes)
    if progress_total:
        progress_total(sum(hi - lo for lo, hi in map(plan.shard_samples, shards)))
    for shard in shards:
        _make_shard(target, out, shard, plan, progress)
    barrier()
    return meta


# ----------------------------------------------------------------------------- what to make


def _target_kind(target: EagleTarget) -> str:
    """Which of the three ways of making data the target takes: "text" (it tokenizes prompt
    texts itself), or a LlamaGen target's "c2i" or "t2i"; the other targets are refused."""
    if takes_text(target):
        return "text"
    if isinstance(target, LlamaGenTarget):
        return "t2i" if target.config.model_type == "t2i" else "c2i"
    raise SpecimgError(f"drafter data is made for LlamaGen targets and targets that take prompt texts, not {type(target).__name__}")


def _source(target: EagleTarget, spec: DataSpec, kind: str) -> tuple[dict[str, Any], int, Tensor | None, Tensor | None]:
    """Where the sequences come from (the settings' record of it), the number of samples, and
    a tokens file's sequences and labels (None when self-distilled)."""
    if kind != "c2i" and spec.tokens_file:
        raise SpecimgError("a tokens file goes with a class-conditional target; a t2i target's data is sampled from prompts")
    tokens: Tensor | None = None
    labels: Tensor | None = None
    if spec.tokens_file:
        tokens, labels = read_tokens_file(spec.tokens_file, target)
        available = tokens.shape[0]
        num = available if spec.num_samples is None else spec.num_samples
        if num > available:
            raise SpecimgError(f"--num-samples {num} exceeds the {available} sequences in {spec.tokens_file}")
        source = {"kind": "tokens", "file": os.path.abspath(spec.tokens_file), "sha256": file_digest(spec.tokens_file)[:16]}
    else:
        if spec.num_samples is None:
            raise SpecimgError("self-distilled data needs --num-samples")
        num = spec.num_samples
        source = {"kind": "self", "sampling": attrs.asdict(spec.sampling), "seed": spec.seed}
    if num < 1:
        raise SpecimgError("drafter data needs at least one sample")
    return source, num, tokens, labels


def _labels(target: EagleTarget, spec: DataSpec, kind: str, num: int, file_labels: Tensor | None) -> Tensor:
    """Each sample's label, once the spec is checked to give the conditions the target's kind
    takes: a target that tokenizes texts, one prompt per sample, and a LlamaGen t2i target,
    one caption per sample, each labelled by its index; a class-conditional target, its
    classes: a tokens file's own, else ``spec.labels`` (by default every class) cycled over
    the samples."""
    if kind == "text":
        if spec.captions or spec.labels or len(spec.prompts) != num:
            raise SpecimgError(
                f"this target's drafter data needs one prompt text per sample ({len(spec.prompts)} for {num}), no captions or labels: "
                "give --prompts or --prompt"
            )
        return torch.arange(num)
    if kind == "t2i":
        if len(spec.captions) != num:
            raise SpecimgError(
                f"a t2i target's drafter data needs one caption per sample ({len(spec.captions)} for {num}): give --prompts and --text-encoder"
            )
        return torch.arange(num)
    num_classes = target.config.num_classes
    if spec.captions:
        raise SpecimgError("captions go with a t2i target; this one is class-conditional: give --class-labels")
    bad = [x for x in spec.labels if not 0 <= x < num_classes]
    if bad:
        raise SpecimgError(f"class label {bad[0]} is outside [0, {num_classes})")
    if file_labels is not None:
        return file_labels[:num]
    cycle = list(spec.labels) or list(range(num_classes))
    return torch.tensor([cycle[i % len(cycle)] for i in range(num)], dtype=torch.long)


def _with_null_examples(target: EagleTarget, spec: DataSpec, kind: str) -> bool:
    """Whether each sequence is also stored under the null condition: by default when the
    target has one (a t2i target always does: uncond_embedding or its own unconditional row)."""
    has_null = kind != "c2i" or target.config.class_dropout_prob > 0
    uncond = has_null if spec.uncond is None else spec.uncond
    if uncond and not has_null:
        raise SpecimgError("this target has no null class (class_dropout_prob = 0): use --no-uncond")
    return uncond


def _settings(plan: _Plan, source: dict[str, Any], layers: list[int] | None) -> dict[str, Any]:
    """Everything the examples depend on besides the target: a folder resumes only under equal settings."""
    spec = plan.spec
    settings = {
        "source": source, "num_samples": plan.num, "labels": plan.labels.tolist(), "uncond": plan.uncond,
        "dtype": spec.dtype, "shard_size": spec.shard_size,
    }
    if layers is not None:  # EAGLE-1 folders keep the settings they always had, so they still resume
        settings.update(drafter_type="eagle3", feature_layers=layers)
    if plan.kind != "c2i":
        settings.update(prompts=list(spec.prompts))
    if plan.kind == "t2i":
        settings.update(captions_sha256=_captions_digest(spec.captions))
    return settings


# ----------------------------------------------------------------------------- the folder


def _open_folder(out: str, meta: dict[str, Any], process_index: int, barrier: Callable[[], None]) -> None:
    """The main process writes the folder's meta, or accepts a folder whose meta has the same
    settings and target (its shards are kept); the others wait for it and stop when it refused the folder."""
    meta_path = os.path.join(out, META)
    if process_index == 0:
        if not os.path.exists(meta_path):
            _atomic_write_json(meta_path, meta)
        else:
            old = _read_meta(out)
            if old.get("settings") != meta["settings"] or old.get("target") != meta["target"]:
                raise SpecimgError(f"{out} holds drafter data made with other settings or another target; use another --out or remove it")
    barrier()
    if process_index != 0 and not os.path.exists(meta_path):
        raise SpecimgError(f"{out} could not be prepared by the main process")


# ----------------------------------------------------------------------------- generating

# one batch's examples: (labels, features, layers) per row, the conditional row first
_Rows = list[tuple[Tensor, Tensor, Tensor | None]]


def _make_shard(target: EagleTarget, out: str, shard: int, plan: _Plan, progress: Callable[[int], None] | None) -> None:
    """Make shard ``shard`` unless a killed run already wrote it: the conditional examples of
    its samples first, then their null-condition twins, so the layout does not depend on the
    batch size."""
    path = os.path.join(out, shard_name(shard))
    lo, hi = plan.shard_samples(shard)
    if os.path.exists(path):
        if progress:
            progress(hi - lo)
        return
    parts: list[list[dict[str, Tensor]]] = [[] for _ in range(1 + plan.uncond)]
    for start in range(lo, hi, plan.spec.batch_size):
        idx = torch.arange(start, min(hi, start + plan.spec.batch_size))
        tokens, rows = (_prompt_batch if plan.kind == "text" else _llamagen_batch)(target, idx, plan)
        for part, (labels, features, layers) in zip(parts, rows):  # row r to part r, the states in the spec's dtype on the CPU
            states = {"features": features, **({"layers": layers} if plan.eagle3 else {})}
            part.append({**{k: v.to("cpu", DTYPES[plan.spec.dtype]) for k, v in states.items()}, "tokens": tokens, "labels": labels, "sample": idx})
        if progress:
            progress(len(idx))
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    # whole or not at all; safetensors reports a full or read-only disk as a SafetensorError, which becomes
    # one line: the shards already written are kept, and the same command resumes from this one
    try:
        with atomic_path(path, ".safetensors") as tmp:
            save_file({k: torch.cat([row[k] for part in parts for row in part]).contiguous() for k in parts[0][0]}, tmp, metadata={"format": FORMAT})
    except SafetensorError as err:
        raise SpecimgError(f"{path} cannot be written ({err}); free space or fix the folder and run the same command again: it resumes") from None


def _llamagen_batch(target: LlamaGenTarget, idx: Tensor, plan: _Plan) -> tuple[Tensor, _Rows]:
    """A LlamaGen target's samples (sampled, or a tokens file's), teacher-forced under their
    conditions and the null condition: a c2i target's classes and the null class
    ``num_classes``; a t2i target's captions and ``uncond_embedding`` with each caption's mask
    (label -1)."""
    labels = plan.labels[idx]
    if plan.kind == "c2i":
        conditions: Any = labels.tolist()
        nulls = torch.full_like(labels, target.config.num_classes)
        given = [(labels, labels), (nulls, nulls)]
    else:
        conditions = [plan.spec.captions[int(i)] for i in idx]
        given = [(labels, conditions), (torch.full_like(labels, -1), [Caption(target.cls_embedding.uncond_embedding, x.mask) for x in conditions])]
    tokens = plan.file_tokens[idx] if plan.file_tokens is not None else ar_tokens(target, conditions, plan.seeds(idx), plan.spec.sampling)
    device = target.tok_embeddings.weight.device
    with torch.inference_mode():  # the last hidden states [B, N, D] and the exposed layers' [B, N, kD] (None: it exposes none)
        given = given[: 1 + plan.uncond]
        outs = [target.forward_sequence(rows.to(device) if isinstance(rows, Tensor) else rows, tokens.to(device)) for _, rows in given]
    return tokens, [(variant, out.hidden, out.layers) for (variant, _), out in zip(given, outs)]


def _prompt_batch(target: EagleTarget, idx: Tensor, plan: _Plan) -> tuple[Tensor, _Rows]:
    """A prompt-text target's samples, sampled by the engine's AR loop and teacher-forced
    through the Target contract, its unconditional row labelled -1."""
    labels = plan.labels[idx]
    prompts = [plan.spec.prompts[int(i)] for i in idx]
    tokens = ar_tokens(target, prompts, plan.seeds(idx), plan.spec.sampling)
    hidden, layers = chain_features(target, prompts, tokens, plan.uncond)
    variants = [(labels, 0), (torch.full_like(labels, -1), -1)]
    return tokens, [(variant, hidden[row], layers[row] if plan.eagle3 else None) for variant, row in variants][: 1 + plan.uncond]


# ----------------------------------------------------------------------------- reading


def _read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, META)
    meta = _read_json(meta_path) if os.path.isfile(meta_path) else None
    if meta is None:
        raise SpecimgError(f"{path} is not a drafter data folder (no {META}); make one with `specimg make-drafter-data`")
    if meta.get("format") != FORMAT:
        raise SpecimgError(f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


class DrafterData:
    """A finished data folder, read lazily (memory-mapped safetensors shards)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.meta = _read_meta(self.path)
        missing = [shard_name(k) for k in range(self.meta["num_shards"]) if not os.path.isfile(os.path.join(self.path, shard_name(k)))]
        if missing:
            raise SpecimgError(
                f"{self.path} is incomplete ({len(missing)} of {self.meta['num_shards']} shards missing, e.g. {missing[0]}); "
                "run make-drafter-data again with the same settings to finish it"
            )
        from safetensors import safe_open

        self._files = [safe_open(os.path.join(self.path, shard_name(k)), framework="pt") for k in range(self.meta["num_shards"])]
        sizes = [f.get_slice("labels").get_shape()[0] for f in self._files]
        self._locate = [(k, j) for k, size in enumerate(sizes) for j in range(size)]
        if len(self._locate) != self.meta["num_examples"]:
            raise SpecimgError(f"{self.path}: shards hold {len(self._locate)} examples, meta.json says {self.meta['num_examples']}")

    def __len__(self) -> int:
        return len(self._locate)

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @property
    def drafter_type(self) -> str:
        """The drafter type the data is for (EAGLE-3 data serves EAGLE-1 too: it holds both)."""
        return self.meta["settings"].get("drafter_type", "eagle1")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.meta["settings"].get("feature_layers", ()))

    def check_target(self, target: EagleTarget) -> None:
        """Refuse a target other than the one that made the data."""
        mine = target_fingerprint(target)
        theirs = self.meta["target"]
        if mine["config"] != theirs["config"]:
            diff = sorted(k for k in mine["config"] if mine["config"][k] != theirs["config"].get(k))
            raise SpecimgError(f"{self.path} was made with a target of another shape (differs in {', '.join(diff)})")
        if mine["head_sha256"] != theirs["head_sha256"]:
            raise SpecimgError(f"{self.path} was made with another target checkpoint (output heads differ)")

    def get(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """Examples ``indices`` stacked: features [b, N, D] float32, tokens [b, N], labels [b]
        (and layers [b, N, kD] float32 in EAGLE-3 data)."""
        keys = ("features", "tokens", "labels", *(("layers",) if self.drafter_type == "eagle3" else ()))
        rows = [self._locate[int(i)] for i in indices]
        batch = {key: torch.cat([self._files[k].get_slice(key)[j : j + 1] for k, j in rows]) for key in keys}
        return {k: v.float() if k in ("features", "layers") else v for k, v in batch.items()}
