"""Conditions as the command line reads them: class labels for c2i targets, caption files for t2i.

Caption files are read from local paths as UTF-8, in four formats chosen by the file name
(docs/usage.md, "Conditions"): ``*.txt`` (or anything not listed here), one caption a line;
``*.jsonl``, a string or an object with a ``caption``, ``prompt`` or ``text`` field (other
fields kept as metadata) or an ``ids`` field, the whole prompt as token ids; ``*.json``,
COCO captions annotations, one caption per image (the lowest annotation id), in image-id
order, as FID-on-COCO evaluations use; ``*.tsv``, PartiPrompts, split at tabs with no
quote processing, so a prompt that starts with ``"`` keeps it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import attrs

from specimg.errors import SpecimgError
from specimg.models.base import PromptIds

_TEXT_KEYS = ("caption", "prompt", "text")
IDS_KEY = "ids"
PARTI_COLUMNS = ("Prompt", "Category", "Challenge", "Note")

MAX_PROMPT_CHARS = 4000
"""The longest prompt (and PartiPrompts field) taken: caption sets' prompts are a sentence
or a paragraph, and a T5 encoder reads 120 tokens of one; more is a file or shell mistake."""

MAX_PROMPT_FILE_BYTES = 1 << 30
"""The largest prompt file read, far above COCO's caption files: a larger one is more likely a
wrong path (a device, an image archive) than prompts."""


@attrs.frozen
class Prompt:
    """One caption and where it came from (``meta``: the file's other fields); a prompt given
    as token ids has them in ``ids`` and no text."""

    text: str
    meta: dict[str, Any] = attrs.field(factory=dict, eq=False)
    ids: PromptIds | None = None

    @property
    def value(self) -> str | PromptIds:
        """The prompt as a target takes it: its ids when it has them, else its text."""
        return self.ids if self.ids is not None else self.text


# ----------------------------------------------------------------------------- class labels


def comma_items(text: str, flag: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``; an empty item (``"a,,b"``, ``"a,"``) is refused: it is
    a typo more often than not, and skipping it would run something else than was asked."""
    if not text.strip():
        raise SpecimgError(f"{flag} {text!r} names nothing: give one value or more, separated by commas")
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise SpecimgError(f"{flag} {text!r} has an empty item: separate values with single commas")
    return items


def class_labels(text: str | None, num_images: int, num_classes: int) -> list[int]:
    """``"3,5"`` -> labels for ``num_images`` images, cycled (3, 5, 3, 5...); none given:
    0, 1, 2, ... cycled over the classes.  Label i never depends on ``num_images``."""
    if not text:
        return [i % num_classes for i in range(num_images)]
    try:
        labels = [int(x) for x in comma_items(text, "--class-labels")]
    except ValueError:
        raise SpecimgError(f"--class-labels takes comma-separated integers, not {text!r}") from None
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
        with open(path, "rb") as fh:
            data = fh.read(MAX_PROMPT_FILE_BYTES + 1)  # bounded: a device such as /dev/zero never ends
    except OSError as err:
        raise SpecimgError(f"cannot read prompt file {path}: {err.strerror or err}") from None
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise SpecimgError(f"prompt file {path} is larger than {MAX_PROMPT_FILE_BYTES >> 20} MiB, the most specimg reads")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of the first line
    except UnicodeDecodeError as err:
        raise SpecimgError(f"cannot read prompt file {path}: byte {err.start} is not UTF-8") from None
    read = next((read for suffix, read in ((".tsv", _parti), (".jsonl", _jsonl), (".json", _coco)) if name.endswith(suffix)), _plain)
    prompts = read(text, path)
    if not prompts:
        raise SpecimgError(f"prompt file {path} holds no caption")
    return prompts


def check_prompt(text: str, where: str) -> None:
    """Refuse a prompt no target can take: blank, longer than :data:`MAX_PROMPT_CHARS`, or
    holding a lone surrogate (a byte that was not UTF-8, as Python passes on what a shell
    gave it, or a JSON ``\\udcff`` escape), which neither a tokenizer nor the manifest can encode."""
    if not text.strip():
        raise SpecimgError(f"{where} is blank: every prompt needs some text")
    _check_length(text, where)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SpecimgError(
            f"{where} holds the lone surrogate {text[err.start]!r} at character {err.start + 1} (a byte that was not UTF-8, "
            "or half of a JSON \\u escape pair): write the prompt as UTF-8 text"
        ) from None


def _check_length(text: str, where: str) -> None:
    if len(text) > MAX_PROMPT_CHARS:
        raise SpecimgError(f"{where} is {len(text)} characters long; a prompt or PartiPrompts field takes at most {MAX_PROMPT_CHARS}")


def _lines(text: str) -> list[tuple[int, str]]:
    """Each non-empty line with its number, split at line feeds only (a CR before one is
    dropped), so that a prompt keeps every other character as written."""
    lines = (line.removesuffix("\r") for line in text.split("\n"))
    return [(number, line) for number, line in enumerate(lines, 1) if line]


def _plain(text: str, path: str) -> list[Prompt]:
    out = []
    for number, line in _lines(text):
        check_prompt(line, f"{path}: line {number}")
        out.append(Prompt(line.strip(), {"line": number}))
    return out


def _json(text: str, where: str) -> Any:
    """``text`` parsed; what the parser refuses, nesting deeper than its stack included, is one line."""
    try:
        return json.loads(text)
    except RecursionError:
        raise SpecimgError(f"{where} nests JSON arrays or objects too deeply to read") from None
    except ValueError as err:  # JSONDecodeError, or an integer longer than Python converts
        raise SpecimgError(f"{where} is not JSON specimg can read: {str(err).split(';')[0]}") from None


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}
    return kinds.get(type(value), "null")


def _jsonl(text: str, path: str) -> list[Prompt]:
    out = []
    for number, line in _lines(text):
        where = f"{path}: line {number}"
        value = _json(line, where)
        if isinstance(value, str):
            check_prompt(value, where)
            out.append(Prompt(value, {"line": number}))
            continue
        if not isinstance(value, dict):
            raise SpecimgError(f"{where} is {_json_kind(value)}, not a string or an object with a {' / '.join(_TEXT_KEYS)} or {IDS_KEY} field")
        key = next((k for k in _TEXT_KEYS if k in value), None)
        if IDS_KEY in value:
            if key is not None:
                raise SpecimgError(f"{where} has both {key!r} and {IDS_KEY!r}: give a prompt as text or as token ids, not both")
            out.append(Prompt("", {k: v for k, v in value.items() if k != IDS_KEY}, _ids(value[IDS_KEY], where)))
            continue
        if key is None or not isinstance(value[key], str):
            found = f": its {key!r} is {_json_kind(value[key])}" if key else ""
            raise SpecimgError(f"{where} has no string field {' / '.join(_TEXT_KEYS)}{found}")
        check_prompt(value[key], where)
        out.append(Prompt(value[key], {k: v for k, v in value.items() if k != key}))
    return out


def _ids(value: Any, where: str) -> PromptIds:
    """A JSON ``ids`` field as prompt ids: a non-empty array of non-negative integers (the
    target checks them against its vocabulary)."""
    if not isinstance(value, list) or not value:
        raise SpecimgError(f"{where}: its {IDS_KEY!r} is {'an empty array' if value == [] else _json_kind(value)}, not an array of token ids")
    bad = next((i for i, x in enumerate(value) if not (_is_int(x) and x >= 0)), None)
    if bad is not None:
        raise SpecimgError(f"{where}: its {IDS_KEY!r} holds {json.dumps(value[bad])[:40]}, not a token id (a non-negative integer)")
    return tuple(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coco(text: str, path: str) -> list[Prompt]:
    data = _json(text, path)
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise SpecimgError(f"{path} is not a COCO captions file (no 'annotations' list)")
    images = data.get("images", [])
    if not isinstance(images, list) or not all(
        isinstance(im, dict) and _is_int(im.get("id")) and isinstance(im.get("file_name", ""), str) for im in images
    ):
        raise SpecimgError(f"{path}: COCO 'images' must be a list of objects with an integer id and a file_name string")
    first: dict[int, dict[str, Any]] = {}
    for index, note in enumerate(data["annotations"]):
        if not (isinstance(note, dict) and _is_int(note.get("image_id")) and _is_int(note.get("id")) and isinstance(note.get("caption"), str)):
            raise SpecimgError(f"{path}: annotations[{index}] is not a COCO caption (an integer image_id and id, a caption string)")
        check_prompt(note["caption"], f"{path}: annotations[{index}] (id {note['id']})")
        if note["image_id"] not in first or note["id"] < first[note["image_id"]]["id"]:
            first[note["image_id"]] = note
    files = {im["id"]: im.get("file_name") for im in images}
    return [Prompt(first[i]["caption"].strip(), {"image_id": i, "id": first[i]["id"], "file_name": files.get(i)}) for i in sorted(first)]


def _parti(text: str, path: str) -> list[Prompt]:
    """Tab-separated values without quoting, as the file is written: a prompt that starts
    with a quote keeps it, and a quote never joins lines."""
    lines = _lines(text)
    header = lines[0][1].split("\t") if lines else []
    if header[: len(PARTI_COLUMNS)] != list(PARTI_COLUMNS):
        raise SpecimgError(f"{path} is not PartiPrompts.tsv (header {'/'.join(PARTI_COLUMNS)} expected)")
    out = []
    for number, line in lines[1:]:
        where = f"{path}: line {number}"
        cells = line.split("\t")
        if len(cells) > len(header):
            raise SpecimgError(f"{where} has {len(cells)} tab-separated fields, the header names {len(header)}")
        fields = dict(zip(header, cells + [""] * (len(header) - len(cells))))
        for column, value in fields.items():
            _check_length(value, f"{where}, column {column}")
        check_prompt(fields["Prompt"], f"{where}, column Prompt")
        out.append(Prompt(fields.pop("Prompt").strip(), {k.lower(): v for k, v in fields.items()}))
    return out


def select_prompts(prompts: Sequence[Prompt], num: int, category: str | None = None) -> list[Prompt]:
    """The first ``num`` prompts (of ``category`` when given, matched against a ``category``
    field case-insensitively), cycled when the file holds fewer."""
    if category is not None:
        prompts = [p for p in prompts if str(p.meta.get("category", "")).lower() == category.lower()]
        if not prompts:
            raise SpecimgError(f"--prompt-category {category!r}: no prompt of the file has this category")
    return [prompts[i % len(prompts)] for i in range(num)]
