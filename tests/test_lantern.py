"""LANTERN's released LlamaGen-T2I folder (Llama names) loads as specimg's LlamaGen t2i
target: tiny files written from the naming table give the original model's logits and
greedy tokens; LANTERN's caption mask is reproduced at padded rows."""

from __future__ import annotations

import json

import pytest
import torch

from lantern_files import write_target
from specimg.config import Sampling
from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.models import load_target
from specimg.models.base import Caption
from specimg.models.lantern import LanternTarget

GREEDY = Sampling(temperature=0.0, cfg_scale=3.0, cfg_interval=1)


def caption(valid: int, seed: int = 0, dim: int = 12, slots: int = 120) -> Caption:
    """A left-padded caption: ``valid`` real features last, zeros before."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(slots, dtype=torch.bool)
    mask[slots - valid :] = True
    return Caption(torch.randn(slots, dim, generator=g) * mask[:, None], mask)


@pytest.fixture
def folder(tmp_path):
    original = write_target(tmp_path / "LlamaGen-T2I")
    return tmp_path / "LlamaGen-T2I", original


@pytest.mark.parametrize("shape", [{}, {"rope_base": 500.0, "n_kv_head": 2}])
def test_the_folder_loads_with_the_original_logits_and_greedy_tokens(tmp_path, shape):
    """Also with the folder's own rope_base and num_key_value_heads (read, not defaulted)."""
    path = tmp_path / "LlamaGen-T2I"
    original = write_target(path, **shape)
    loaded = load_target(path)
    assert isinstance(loaded, LanternTarget) and loaded.config.ffn_hidden == original.config.ffn_hidden
    cond = caption(7)
    first = [t.prefill(cond, cfg=True).logits for t in (original, loaded)]
    assert torch.equal(first[0], first[1])
    step = [t.forward_tree(torch.tensor([5]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool)).logits for t in (original, loaded)]
    assert (step[0] - step[1]).abs().max().item() == 0.0
    tokens = [Engine(t, method="ar", sampling=GREEDY).generate([cond, caption(30, seed=1)], seed=0).tokens for t in (original, loaded)]
    assert torch.equal(torch.as_tensor(tokens[0]), torch.as_tensor(tokens[1]))


def test_padded_rows_follow_lanterns_mask_and_change_no_logit(folder):
    path, original = folder
    loaded = load_target(path)
    cond = caption(7)
    assert torch.equal(original.prefill(cond, cfg=True).logits, loaded.prefill(cond, cfg=True).logits)
    theirs, ours = original.condition_hidden(), loaded.condition_hidden()
    assert torch.equal(theirs[:, -7:], ours[:, -7:])  # valid rows: the same
    assert (theirs[:, :-7] - ours[:, :-7]).abs().max() > 1e-3  # padded rows: LANTERN's


def lantern_float_mask(caption_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """LANTERN's prefill mask, transcribed: float32 minimum above the diagonal, plus the
    weights' dtype minimum at padded keys (the transformers 4.32 helpers it copies)."""
    s = caption_mask.shape[-1]
    causal = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)
    padding = (1.0 - caption_mask[:, None, :].to(dtype).expand(-1, s, s)).float()
    padding = padding.masked_fill(padding.bool(), torch.finfo(dtype).min)
    return padding + causal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_caption_mask_is_lanterns_float_mask(folder, dtype):
    """Scores at condition positions are all 0 (zero rotation): the keys a row attends are
    those where softmax(mask) is not 0, in every dtype."""
    path, _ = folder
    target = load_target(path, dtype=dtype)
    caption_mask = torch.stack([caption(7).mask, caption(120).mask, caption(1).mask, caption(0).mask])
    weights = torch.softmax(lantern_float_mask(caption_mask, dtype), dim=-1)
    assert torch.equal(target.condition_mask(caption_mask), weights > 0)


def test_a_llama_folder_that_is_no_llamagen_conversion_is_refused(folder):
    path, _ = folder
    config = json.loads((path / "config.json").read_text())
    del config["input_type"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecimgError, match="a Llama folder that is no LlamaGen conversion"):
        load_target(path)


def test_options_a_lantern_folder_does_not_take_are_refused(folder):
    with pytest.raises(SpecimgError, match="takes its shape from its config.json, not from 'preset'"):
        load_target(folder[0], preset="GPT-B")
