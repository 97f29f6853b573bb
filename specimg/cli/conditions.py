"""What each image is conditioned on, from the command line: class labels for a
class-conditional (c2i) target; prompts (``--prompt TEXT``, ``--prompts FILE``) turned into
caption features by a text encoder for a text-conditional (t2i) LlamaGen, or passed as
texts to a target that tokenizes them itself (Janus, Lumina-mGPT).  Such a target also
takes whole prompts as token ids (``--prompt-ids``, a ``.jsonl``'s ``ids`` field), so a
folder without a text tokenizer can be prompted; a run's prompts are all texts or all ids.

``generate``, ``bench`` and ``make-drafter-data`` share this, so a condition that does not
fit the target is refused with the same message everywhere, and image i gets the same
condition in every command (labels and prompts are cycled over the images).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from specimg.errors import SpecimgError
from specimg.models.base import Condition, PromptIds, takes_text


class Conditions(NamedTuple):
    """One condition per image, its JSON key (class id, prompt text, or prompt ids as a list)
    and the prompt texts (None for c2i and for prompt ids)."""

    values: list[Condition]
    keys: list[Any]
    prompts: list[str] | None

    @property
    def field(self) -> str:
        """The manifest field that records each image's key."""
        if self.prompts is not None:
            return "prompt"
        return "prompt_ids" if self.values and isinstance(self.values[0], tuple) else "condition"


def shorten(text: str, width: int = 40) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters, marked with '...'
    (a grid label: the full prompt is in the manifest)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: width - 3].rsplit(" ", 1)[0] if " " in text[: width - 3] else text[: width - 3]
    return cut + "..."


def grid_label(entry: dict[str, Any]) -> str:
    """A manifest entry's label in a grid: its prompt or prompt ids, shortened, or its class."""
    from specimg.runs.images import condition_label

    return shorten(condition_label(next(entry[field] for field in ("prompt", "prompt_ids", "condition") if field in entry)))


def is_t2i(target: Any) -> bool:
    return getattr(getattr(target, "config", None), "model_type", "c2i") == "t2i"


def _preview(text: str, width: int = 40) -> str:
    """A prompt as a message about it shows it: its first ``width`` characters (it may be far longer)."""
    return f"{text[:width]!r}{'...' if len(text) > width else ''}"


def _given_prompts(kw: dict[str, Any]) -> list[tuple[str, str | PromptIds]]:
    """Each prompt the flags give with its source ("--prompt", "--prompt-ids" or the file):
    the ``--prompt`` texts, the ``--prompt-ids``, then those of ``--prompts`` (only
    ``--prompt-category``'s when given)."""
    from specimg.cli.prompts import check_prompt, read_prompts, select_prompts

    given: list[tuple[str, str | PromptIds]] = []
    for text in kw.get("prompt") or ():
        check_prompt(text, f"--prompt {_preview(text)}")
        given.append(("--prompt", text))
    given += [("--prompt-ids", tuple(ids)) for ids in kw.get("prompt_ids") or ()]
    if kw.get("prompts"):
        file_prompts = read_prompts(kw["prompts"])
        given += [(kw["prompts"], p.value) for p in select_prompts(file_prompts, len(file_prompts), kw.get("prompt_category"))]
    return given


def _all_ids(given: list[tuple[str, str | PromptIds]]) -> bool:
    """Whether the prompts are all token ids, else all texts: a run mixing them is refused,
    as its manifest records one kind (field ``prompt`` or ``prompt_ids``) to resume on."""
    texts = [source for source, prompt in given if isinstance(prompt, str)]
    ids = [source for source, prompt in given if not isinstance(prompt, str)]
    if texts and ids:
        mix = f"{texts[0]} holds both texts and token ids" if texts[0] == ids[0] else f"{texts[0]} gives texts and {ids[0]} token ids"
        raise SpecimgError(f"a run's prompts are all texts or all token ids: {mix}")
    return bool(ids)


def _checked_ids(target: Any, given: list[tuple[str, str | PromptIds]]) -> None:
    """Refuse, before anything runs, prompt ids the target cannot take (an id outside its
    vocabulary; for Janus, ids not ending in begin-of-image), naming where they came from."""
    for source, ids in dict.fromkeys(given):
        try:
            target.prompt_ids(ids)
        except SpecimgError as err:
            shown = _preview(",".join(map(str, ids)))
            name = f"--prompt-ids {shown}" if source == "--prompt-ids" else f"{source}: the prompt ids {shown}"
            raise SpecimgError(f"{name}: {err}") from None


_T2I_IDS = "{} token ids, which a LlamaGen t2i target cannot take: it encodes prompt texts with --text-encoder; give --prompt or --prompts"
"""Why a LlamaGen t2i target refuses prompt ids, after what gave them."""


def _refuse_unused_flags(target: Any, kw: dict[str, Any]) -> None:
    """Refuse a condition flag this target would ignore, before anything is read or encoded."""
    if kw.get("prompt_category") and not kw.get("prompts"):
        raise SpecimgError("--prompt-category picks among the prompts of --prompts FILE: give the file, or drop --prompt-category")
    if kw.get("prompt") and kw.get("prompt_ids"):
        raise SpecimgError("--prompt and --prompt-ids do not go together: give a run's prompts all as texts or all as token ids")
    if not (takes_text(target) or is_t2i(target)):
        if kw.get("prompt") or kw.get("prompts") or kw.get("prompt_ids"):
            raise SpecimgError("--prompt / --prompts / --prompt-ids needs a t2i target; this one is class-conditional: give --class-labels")
        if kw.get("text_encoder"):
            raise SpecimgError("--text-encoder is for LlamaGen t2i targets; this one is class-conditional: drop it")
    elif kw.get("class_labels"):
        raise SpecimgError(f"this target is text-conditional{'' if takes_text(target) else ' (t2i)'}: give --prompt or --prompts, not --class-labels")
    elif takes_text(target) and kw.get("text_encoder"):
        raise SpecimgError("--text-encoder is for LlamaGen t2i targets; this one tokenizes prompts with its own folder's tokenizer: drop it")
    elif not takes_text(target) and kw.get("prompt_ids"):
        raise SpecimgError(_T2I_IDS.format("--prompt-ids gives"))


def conditions_for(target: Any, kw: dict[str, Any]) -> Conditions:
    """The conditions the flags ask for (``num_images``, ``class_labels``, ``prompt``,
    ``prompt_ids``, ``prompts``, ``prompt_category``, ``text_encoder``), checked against the target."""
    from specimg.cli.prompts import class_labels
    from specimg.models.text_encoder import captions_for_target, load_text_encoder

    _refuse_unused_flags(target, kw)
    n = kw["num_images"]
    if not (takes_text(target) or is_t2i(target)):
        labels = class_labels(kw.get("class_labels"), n, target.config.num_classes)
        return Conditions(list(labels), list(labels), None)
    if not (kw.get("prompt") or kw.get("prompts") or kw.get("prompt_ids")):
        if takes_text(target):
            raise SpecimgError("a text-conditional target needs --prompts FILE or --prompt TEXT (or --prompt-ids IDS where its folder has no text tokenizer)")
        raise SpecimgError("a t2i target needs --prompts FILE or --prompt TEXT, and --text-encoder")
    if not takes_text(target) and not kw.get("text_encoder"):
        raise SpecimgError("prompts need --text-encoder: a local T5 folder (flan-t5-xl for LlamaGen) or a specimg text-encoder file")
    given = _given_prompts(kw)
    prompts = [given[i % len(given)][1] for i in range(n)]  # cycled over the images
    if _all_ids(given):
        if not takes_text(target):
            raise SpecimgError(_T2I_IDS.format(f"{kw['prompts']} gives"))
        _checked_ids(target, given)
        return Conditions(prompts, [list(ids) for ids in prompts], None)
    if not takes_text(target):
        config = target.config
        captions = captions_for_target(load_text_encoder(kw["text_encoder"]), prompts, config.cls_token_num, config.caption_dim)
        return Conditions(list(captions), list(prompts), prompts)
    if getattr(target, "text_tokenizer", True) is None:  # Janus, Lumina-mGPT: the folder had none
        raise SpecimgError(
            "this target's folder has no text tokenizer (tokenizer.json or tokenizer.model) to read --prompt / --prompts with: "
            "give each prompt as token ids (--prompt-ids, or a .jsonl's ids field; see docs/models.md)"
        )
    return Conditions(list(prompts), list(prompts), prompts)


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
