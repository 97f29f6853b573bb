"""Lumina-mGPT as a speculative-decoding target, over transformers' ``ChameleonForConditionalGeneration``.

Image generation as the released inference code (Alpha-VLLM/Lumina-mGPT,
``inference_solver.py``) runs it:

- the prompt is BOS, ``Generate an image of {w}x{h} according to the following prompt:\\n{text}``
  and the turn separator ``<reserved08706>``; the image then opens with ``<racm3:break>`` and
  two size tokens (``<reserved{8800 + pixels / 32}>``, height then width), which the
  model samples in Lumina-mGPT and the target feeds itself, fixing the size;
- every row of image codes ends with the newline token ``<reserved08799>``, which Lumina-mGPT
  forces; the target feeds it too, so drafts and the engine only ever see image codes and
  positions count the newlines;
- logits are restricted to the image codes (BPE ids of Chameleon's ``IMGIMG`` tokens, in code
  order through its vocabulary mapping), as Lumina-mGPT's logits processor suppresses the rest;
- the unconditional row starts at ``<racm3:break>`` with positions restarting at 0 (no prompt);
  CFG is ``uncond + s * (cond - uncond)``.  Lumina-mGPT samples image codes at temperature 1,
  CFG 4 and an image top-k of 2000: ``Sampling(cfg_scale=4.0, top_k=2000)``.

Both rows run in one batch: the unconditional row is left-padded to the prompt's length with
masked slots.  A draft tree is expanded with a newline node after every node that ends a row;
each node's outputs are read at its newline node when it has one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Union

import attrs
import torch
from torch import Tensor

from specimg.config import Sampling
from specimg.errors import SpecimgError
from specimg.models.base import TargetOutput, cfg_rows
from specimg.models.hf import HFOptions, HFTarget, additive_mask, given_prompt_ids, load_folder, parse_options

from transformers import ChameleonForConditionalGeneration  # isort: skip (hf explains a missing extra)

IMAGE_START = "<racm3:break>"
NEW_LINE = "<reserved08799>"
TURN_END = "<reserved08706>"
PROMPT_TEMPLATE = "Generate an image of {size}x{size} according to the following prompt:\n{text}"
PIXELS_PER_SIZE_UNIT = 32  # a size token counts 32-pixel units: 2x2 codes of the 16x VQGAN


LuminaCondition = Union[str, Tensor, Sequence[int]]
"""A prompt text, or prompt ids already in the template (up to the turn separator)."""


@attrs.frozen
class LuminaOptions(HFOptions):
    """:class:`~specimg.models.hf.HFOptions` and ``image_size`` in pixels (square, a multiple
    of 32; Lumina-mGPT-7B-768 draws 768)."""

    image_size: int = attrs.field(default=768)

    @image_size.validator
    def _check_size(self, attribute: Any, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < PIXELS_PER_SIZE_UNIT or value % PIXELS_PER_SIZE_UNIT:
            raise ValueError(f"image_size must be a positive multiple of {PIXELS_PER_SIZE_UNIT}, not {value!r}")


class LuminaTarget(HFTarget):
    """Chameleon-architecture Lumina-mGPT with the :class:`~specimg.models.base.Target` interface."""

    default_sampling = Sampling(cfg_scale=4.0, top_k=2000)
    """Lumina-mGPT's demo: CFG 4, temperature 1, image top-k 2000."""

    def __init__(self, model: ChameleonForConditionalGeneration, image_size: int = 768, text_tokenizer: Any = None) -> None:
        super().__init__(model, model.config, text_tokenizer)
        self.image_size = image_size
        self.side = image_size // 16
        self.num_tokens = self.side * self.side
        vocab = model.config.vocabulary_map or {}
        names = [IMAGE_START, NEW_LINE, f"<reserved{8800 + image_size // PIXELS_PER_SIZE_UNIT:05d}>"]  # the size token
        missing = [name for name in names if name not in vocab]
        if missing:
            raise SpecimgError(f"the Chameleon vocabulary lacks {', '.join(missing)}: not a Lumina-mGPT model, or no {image_size}-px size token")
        self.start_id, self.newline_id, self.size_id = (int(vocab[name]) for name in names)
        img2bpe = model.model.vocabulary_mapping.img2bpe
        self.vocab_size = len(img2bpe)
        if sorted(img2bpe) != list(range(self.vocab_size)):
            raise SpecimgError("the Chameleon vocabulary's image tokens do not name codes 0..K-1")
        self._code_bpe = torch.tensor([img2bpe[c] for c in range(self.vocab_size)], device=self._device)
        self._pad = torch.zeros(1, dtype=torch.long)  # [rows]: masked slots before each row's sequence
        self._base = torch.zeros(1, dtype=torch.long)  # [rows]: position of image code 0

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Moving the weights drops the cache and the tables made from them; the code-to-BPE table follows the device."""
        super()._apply(fn, recurse)
        self._code_bpe = self._code_bpe.to(self._device)
        return self

    # -- Target protocol

    @torch.no_grad()
    def prefill(self, condition: LuminaCondition, cfg: bool) -> TargetOutput:
        device = self._device
        prompt = self.prompt_ids(condition).to(device)
        head = torch.tensor([self.start_id, self.size_id, self.size_id], device=device)
        p, rows = prompt.shape[0], cfg_rows(cfg)
        length = p + 3
        ids = torch.cat([prompt, head])[None].repeat(rows, 1)
        self._pad = torch.tensor([0, p][:rows], device=device)
        positions = torch.arange(length, device=device)[None] - self._pad[:, None]
        if cfg:
            ids[1, :p] = self.start_id  # masked padding; any id would do
        keys = torch.arange(length, device=device)
        allowed = (keys[None, :] <= keys[:, None]) & (keys[None, None, :] >= self._pad[:, None, None])
        allowed |= torch.eye(length, dtype=torch.bool, device=device)  # padding sees itself: no empty softmax
        self._base = positions[:, -1] + 1
        return self._start(
            self.model.model, rows, length, input_ids=ids, attention_mask=additive_mask(allowed, self._dtype), position_ids=positions.clamp(min=0)
        )

    @torch.no_grad()
    def forward_tree(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        device, start, n = self._device, self._open_tree(), tokens.shape[0]
        tokens, depths, mask = tokens.to(device), depths.to(device), mask.to(device)
        code = self._codes + depths
        newline = (code % self.side == self.side - 1) & (code + 1 < self.num_tokens)
        slot = torch.arange(n, device=device) + torch.cumsum(newline, 0) - newline.long()
        nl_slot = torch.where(newline, slot + 1, -1)
        total = n + int(newline.sum())
        ids = torch.full((total,), self.newline_id, device=device)
        ids[slot] = self._code_bpe[tokens]
        offset = torch.zeros(total, dtype=torch.long, device=device)
        offset[slot] = code + code // self.side
        offset[nl_slot[newline]] = offset[slot[newline]] + 1
        allowed = torch.zeros(total, total, dtype=torch.bool, device=device)
        nl = nl_slot[newline]
        allowed[slot[:, None], slot[None, :]] = mask
        allowed[slot[:, None], nl[None, :]] = (mask & ~torch.eye(n, dtype=torch.bool, device=device))[:, newline]
        allowed[nl[:, None], slot[None, :]] = mask[newline]
        allowed[nl[:, None], nl[None, :]] = mask[newline][:, newline]
        prefix = torch.arange(start, device=device)[None, None, :] >= self._pad[:, None, None]
        full = torch.cat([prefix.expand(self._rows, total, start), allowed[None].expand(self._rows, -1, -1)], dim=2)
        self._pending = torch.stack([slot, nl_slot], dim=1)  # committing a node keeps its newline
        return self._run(
            self.model.model,
            torch.where(newline, nl_slot, slot),
            input_ids=ids[None].expand(self._rows, -1),
            attention_mask=additive_mask(full, self._dtype),
            position_ids=self._base[:, None] + offset[None],
            cache_position=torch.arange(start, start + total, device=device),
        )

    # -- what an EAGLE drafter borrows (specimg.models.eagle.EagleTarget)

    def code_positions(self) -> Tensor:
        """Counting the forced newline after every row: image token k sits k + k // side
        positions after image token 0."""
        k = torch.arange(self.num_tokens, device=self._device)
        return k + k // self.side

    def embed_codes(self, tokens: Tensor) -> Tensor:
        """Each image code's BPE token's row."""
        return self.model.model.embed_tokens(self._code_bpe[tokens])

    def code_logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(hidden)[..., self._code_bpe]

    # -- prompts

    def prompt_ids(self, condition: LuminaCondition) -> Tensor:
        """The prompt ids [L] in Lumina-mGPT's template, up to and including the turn separator.

        A text is put in the template and tokenized with the folder's tokenizer after BOS; ids
        are taken as they are, once checked to lie in the model's vocabulary."""
        if isinstance(condition, str):
            if self.text_tokenizer is None:
                raise SpecimgError("this Lumina-mGPT folder has no tokenizer: pass prompt ids instead of text")
            text = PROMPT_TEMPLATE.format(size=self.image_size, text=condition.strip()) + TURN_END
            ids = self.text_tokenizer.encode(text, add_special_tokens=False)
            return torch.tensor([int(self.model.config.bos_token_id), *ids])
        return given_prompt_ids(condition, self.model.model.embed_tokens.num_embeddings, "Lumina-mGPT")

    # -- internals

    @property
    def _dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype


UNUSED_WEIGHTS = ("model.vqmodel.",)
"""Chameleon's VQ encoder, which generation never runs (codes decode with the VQGAN checkpoint):
a folder's weights there are not checked."""


def load_lumina_target(path: str | os.PathLike[str], **overrides: Any) -> LuminaTarget:
    """Load a local Hugging Face Lumina-mGPT folder (``model_type`` "chameleon", e.g.
    Lumina-mGPT-7B-768); nothing is downloaded.  ``overrides``: the fields of
    :class:`LuminaOptions`.  Its images decode with Chameleon's VQGAN
    (:func:`specimg.models.chameleon_vq.load_chameleon_vq_decoder`)."""
    options = parse_options(LuminaOptions, overrides, "Lumina-mGPT")
    model, text_tokenizer = load_folder(path, "chameleon", ChameleonForConditionalGeneration, options, unused=UNUSED_WEIGHTS)
    return LuminaTarget(model, options.image_size, text_tokenizer)
