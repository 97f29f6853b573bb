"""Janus-Pro as a speculative-decoding target, over transformers' ``JanusForConditionalGeneration``.

Image generation as the released inference code (deepseek-ai/Janus, ``generation_inference.py``)
and transformers' ``generate(generation_mode="image")`` run it:

- the prompt is ``<|User|>: {text}\\n\\n<|Assistant|>:`` after BOS, then the begin-of-image
  token; the logits at begin-of-image give image token 0;
- the unconditional row is the same sequence with every token except BOS and begin-of-image
  replaced by the pad id; CFG is ``uncond + s * (cond - uncond)`` (specimg's sampling);
- an image code is fed back as ``generation_aligner(generation_embeddings(code))`` and scored
  by ``generation_head`` on the language model's final-norm hidden state;
- positions are plain 1-D sequence positions (Llama RoPE), so a tree node at depth d sits at
  position ``committed + d``.

The language model runs with a ``DynamicCache``; a tree is verified in one forward with a
4-D additive mask and explicit ``position_ids``, and ``commit`` moves the accepted path's
entries down to the committed prefix and crops the rest.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specimg.config import Sampling
from specimg.errors import SpecimgError
from specimg.models.base import TargetOutput, cfg_rows
from specimg.models.hf import HFOptions, HFTarget, additive_mask, given_prompt_ids, load_folder, parse_options
from specimg.models.vq import code_grid

from transformers import JanusForConditionalGeneration  # isort: skip (hf explains a missing extra)

PROMPT_TEMPLATE = "<|User|>: {}\n\n<|Assistant|>:"
"""Janus's one-turn image prompt (the DeepSeek SFT format with an empty system prompt)."""

JanusCondition = Union[str, Tensor, Sequence[int]]
"""A prompt text, or prompt ids already in the template (ending in begin-of-image)."""


class JanusVQTokenizer:
    """Janus's VQ model with specimg's tokenizer interface; it shares the target's weights."""

    def __init__(self, vqmodel: nn.Module) -> None:
        self.vqmodel = vqmodel

    @property
    def vocab_size(self) -> int:
        return int(self.vqmodel.config.num_embeddings)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, n] (row-major, n = the grid's cells) -> images [B, 3, H, W] in about [-1, 1]."""
        side = self.vqmodel.quantize.quant_state_dims[0]
        code_grid(codes, (side, side), self.vocab_size, "the VQ codebook")
        return self.vqmodel.decode(codes.to(self.vqmodel.post_quant_conv.weight.device, torch.long))

    @torch.no_grad()
    def codebook_vectors(self) -> Tensor:
        """[K, d]: the code vectors the decoder sees (Janus L2-normalises them when decoding)."""
        return F.normalize(self.vqmodel.quantize.embedding.weight.detach(), dim=-1)

    @torch.no_grad()
    def raw_codebook_vectors(self) -> Tensor:
        """[K, d]: the codebook as stored, before the normalisation (LANTERN's neighbours)."""
        return self.vqmodel.quantize.embedding.weight.detach()


class JanusTarget(HFTarget):
    """``JanusForConditionalGeneration`` with the :class:`~specimg.models.base.Target` interface."""

    default_sampling = Sampling(cfg_scale=5.0)
    """The released inference code's: CFG 5, temperature 1, no top-k."""

    def __init__(self, model: JanusForConditionalGeneration, text_tokenizer: Any = None) -> None:
        super().__init__(model, model.config.text_config, text_tokenizer)
        config = model.config
        self.vocab_size = int(config.vq_config.num_embeddings)
        self.num_tokens = int(config.vision_config.num_image_tokens)
        side = model.model.vqmodel.quantize.quant_state_dims[0]
        if side * side != self.num_tokens:
            raise SpecimgError(f"Janus config: {self.num_tokens} image tokens do not fill the VQ model's {side}x{side} grid")
        gen = model.generation_config
        boi = (getattr(gen, "generation_kwargs", None) or {}).get("boi_token_id", getattr(gen, "boi_token_id", None))
        ids = {"bos_token_id": gen.bos_token_id, "pad_token_id": gen.pad_token_id, "boi_token_id": boi}
        missing = [name for name, value in ids.items() if value is None]
        if missing:
            raise SpecimgError(f"the Janus generation config lacks {', '.join(missing)} (generation_config.json)")
        self.bos_id, self.pad_id, self.boi_id = int(gen.bos_token_id), int(gen.pad_token_id), int(boi)

    def vq_tokenizer(self) -> JanusVQTokenizer:
        """The image tokenizer that decodes this target's codes."""
        return JanusVQTokenizer(self.model.model.vqmodel)

    # -- Target protocol

    @torch.no_grad()
    def prefill(self, condition: JanusCondition, cfg: bool) -> TargetOutput:
        ids = self.prompt_ids(condition).to(self._device)
        rows = ids[None].repeat(cfg_rows(cfg), 1)
        if cfg:
            rows[1] = torch.where((ids == self.bos_id) | (ids == self.boi_id), ids, torch.full_like(ids, self.pad_id))
        return self._start(self.model.model.language_model, rows.shape[0], ids.shape[0], inputs_embeds=self.model.get_input_embeddings()(rows))

    @torch.no_grad()
    def forward_tree(self, tokens: Tensor, depths: Tensor, mask: Tensor) -> TargetOutput:
        n, start, device = tokens.shape[0], self._open_tree(), self._device
        x = self.model.prepare_embeddings_for_image_generation(tokens.to(device))
        x = x[None].expand(self._rows, n, -1)
        attn = None  # the AR path: the root alone sees everything
        if n > 1:
            allowed = torch.cat([torch.ones(n, start, dtype=torch.bool, device=device), mask.to(device)], dim=1)
            attn = additive_mask(allowed[None], x.dtype).expand(self._rows, 1, n, start + n)
        self._pending = torch.arange(n, device=device)
        return self._run(
            self.model.model.language_model,
            slice(None),
            inputs_embeds=x,
            attention_mask=attn,
            position_ids=(depths.to(device) + start)[None].expand(self._rows, n),
            cache_position=torch.arange(start, start + n, device=device),
        )

    # -- what an EAGLE drafter borrows (specimg.models.eagle.EagleTarget)

    def code_positions(self) -> Tensor:
        """Image token k sits k positions after image token 0."""
        return torch.arange(self.num_tokens, device=self._device)

    def embed_codes(self, tokens: Tensor) -> Tensor:
        """``generation_aligner(generation_embeddings(code))``."""
        return self.model.prepare_embeddings_for_image_generation(tokens)

    def code_logits(self, hidden: Tensor) -> Tensor:
        return self.model.model.generation_head(hidden)

    # -- prompts

    def prompt_ids(self, condition: JanusCondition) -> Tensor:
        """The prompt ids [L] in Janus's image template, ending in begin-of-image.

        A text is put in the template and tokenized with the folder's tokenizer; ids are taken
        as they are (as ``JanusProcessor(generation_mode="image")`` returns them), once checked
        to lie in the language model's vocabulary."""
        if isinstance(condition, str):
            if self.text_tokenizer is None:
                raise SpecimgError("this Janus folder has no tokenizer: pass prompt ids instead of text")
            ids = self.text_tokenizer.encode(PROMPT_TEMPLATE.format(condition.strip()))
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
            return torch.tensor([*ids, self.boi_id])
        ids = given_prompt_ids(condition, self.model.get_input_embeddings().num_embeddings, "Janus")
        if int(ids[-1]) != self.boi_id:
            raise SpecimgError(f"prompt ids must end in begin-of-image ({self.boi_id}), as the template's ids do")
        return ids


def load_janus_target(path: str | os.PathLike[str], **overrides: Any) -> JanusTarget:
    """Load a local Hugging Face Janus folder (``model_type`` "janus", e.g. the Janus-Pro-1B/7B
    conversions); nothing is downloaded.  ``overrides``: the fields of
    :class:`~specimg.models.hf.HFOptions` (device, dtype, attn_implementation)."""
    options = parse_options(HFOptions, overrides, "Janus")
    model, text_tokenizer = load_folder(path, "janus", JanusForConditionalGeneration, options)
    return JanusTarget(model, text_tokenizer)
