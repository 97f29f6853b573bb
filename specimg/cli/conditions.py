"""What each image is conditioned on, from the command line: class labels for a
class-conditional (c2i) target; prompts (``--prompt TEXT``, ``--prompts FILE``) turned into
caption features by a text encoder for a text-conditional (t2i) LlamaGen, or passed as
texts to a target that tokenizes them itself (Janus, Lumina-mGPT).

``generate``, ``bench`` and ``make-drafter-data`` share this, so a condition that does not
fit the target is refused with the same message everywhere, and image i gets the same
condition in every command (labels and prompts are cycled over the images).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from specimg.errors import SpecimgError
from specimg.models.base import Condition, takes_text


class Conditions(NamedTuple):
    """One condition per image, its JSON key (class id or prompt text) and the prompts (None for c2i)."""

    values: list[Condition]
    keys: list[Any]
    prompts: list[str] | None


def shorten(text: str, width: int = 40) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters, marked with '...'
    (a grid label: the full prompt is in the manifest)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: width - 3].rsplit(" ", 1)[0] if " " in text[: width - 3] else text[: width - 3]
    return cut + "..."


def is_t2i(target: Any) -> bool:
    return getattr(getattr(target, "config", None), "model_type", "c2i") == "t2i"


PREVIEW = 40
"""Characters of a ``--prompt`` shown in a message about it (it may be far longer)."""


def prompt_texts(kw: dict[str, Any], num: int) -> list[str]:
    """The ``--prompt`` texts, then those of ``--prompts`` (only ``--prompt-category``'s
    when given), cycled over ``num`` images; the caller has checked that there are some."""
    from specimg.cli.prompts import check_prompt, read_prompts, select_prompts

    texts = list(kw.get("prompt") or ())
    for text in texts:
        check_prompt(text, f"--prompt {text[:PREVIEW]!r}{'...' if len(text) > PREVIEW else ''}")
    if kw.get("prompts"):
        file_prompts = read_prompts(kw["prompts"])
        texts += [p.text for p in select_prompts(file_prompts, len(file_prompts), kw.get("prompt_category"))]
    return [texts[i % len(texts)] for i in range(num)]


def _refuse_unused_flags(target: Any, kw: dict[str, Any]) -> None:
    """Refuse a condition flag this target would ignore, before anything is read or encoded."""
    if kw.get("prompt_category") and not kw.get("prompts"):
        raise SpecimgError("--prompt-category picks among the prompts of --prompts FILE: give the file, or drop --prompt-category")
    if takes_text(target):
        if kw.get("class_labels"):
            raise SpecimgError("this target is text-conditional: give --prompt or --prompts, not --class-labels")
        if kw.get("text_encoder"):
            raise SpecimgError("--text-encoder is for LlamaGen t2i targets; this one tokenizes prompts with its own folder's tokenizer: drop it")
    elif is_t2i(target):
        if kw.get("class_labels"):
            raise SpecimgError("this target is text-conditional (t2i): give --prompt or --prompts, not --class-labels")
    else:
        if kw.get("prompt") or kw.get("prompts"):
            raise SpecimgError("--prompt / --prompts needs a t2i target; this one is class-conditional: give --class-labels")
        if kw.get("text_encoder"):
            raise SpecimgError("--text-encoder is for LlamaGen t2i targets; this one is class-conditional: drop it")


def conditions_for(target: Any, kw: dict[str, Any]) -> Conditions:
    """The conditions the flags ask for (``num_images``, ``class_labels``, ``prompt``,
    ``prompts``, ``prompt_category``, ``text_encoder``), checked against the target."""
    from specimg.cli.prompts import class_labels
    from specimg.models.text_encoder import captions_for_target, load_text_encoder

    _refuse_unused_flags(target, kw)
    n = kw["num_images"]
    wants_prompts = bool(kw.get("prompt") or kw.get("prompts"))
    if takes_text(target):
        if not wants_prompts:
            raise SpecimgError("a text-conditional target needs --prompts FILE or --prompt TEXT")
        if hasattr(target, "text_tokenizer") and target.text_tokenizer is None:  # Janus, Lumina-mGPT: the folder had none
            raise SpecimgError("this target's folder has no text tokenizer (tokenizer.json or tokenizer.model) to read --prompt / --prompts with")
        texts = prompt_texts(kw, n)
        return Conditions(list(texts), list(texts), texts)
    if not is_t2i(target):
        labels = class_labels(kw.get("class_labels"), n, target.config.num_classes)
        return Conditions(list(labels), list(labels), None)
    if not wants_prompts:
        raise SpecimgError("a t2i target needs --prompts FILE or --prompt TEXT, and --text-encoder")
    if not kw.get("text_encoder"):
        raise SpecimgError("prompts need --text-encoder: a local T5 folder (flan-t5-xl for LlamaGen) or a specimg text-encoder file")
    texts = prompt_texts(kw, n)
    config = target.config
    captions = captions_for_target(load_text_encoder(kw["text_encoder"]), texts, config.cls_token_num, config.caption_dim)
    return Conditions(list(captions), list(texts), texts)


def sample_captions(target: Any, kw: dict[str, Any]) -> tuple[tuple[Condition, ...], tuple[str, ...]]:
    """``make-drafter-data``'s captions, one per sample (``num_samples``), and their prompts;
    none for a c2i target, which samples under class labels, and only the prompts for a
    target that tokenizes them itself."""
    _refuse_unused_flags(target, kw)
    if not (is_t2i(target) or takes_text(target)):
        return (), ()
    if kw.get("num_samples") is None:
        raise SpecimgError("drafter data from prompts needs --num-samples")
    conditions = conditions_for(target, {**kw, "num_images": kw["num_samples"]})
    return (() if takes_text(target) else tuple(conditions.values)), tuple(conditions.keys)
