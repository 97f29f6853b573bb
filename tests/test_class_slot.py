"""The class-reading initialisation of the demo target: same architecture, class slot read."""

from __future__ import annotations

import pytest
import torch

from specimg.demo.class_slot import class_slot_weight, init_class_reading_heads
from specimg.models.llamagen import build_target

TINY = dict(dim=64, n_layer=3, n_head=4, multiple_of=16, vocab_size=64, num_classes=10, block_size=64, class_dropout_prob=0.1)


def test_class_reading_heads_attend_to_the_class_slot_without_changing_shapes() -> None:
    plain, model = build_target("GPT-B", seed=0, **TINY), build_target("GPT-B", seed=0, **TINY)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    weights = init_class_reading_heads(model, score=5.0)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    g = torch.Generator().manual_seed(1)
    labels, tokens = torch.arange(4), torch.randint(0, 64, (4, 64), generator=g)
    # at init every image position spreads its weight evenly: about 1/position on the class slot
    assert max(class_slot_weight(plain, labels, tokens)) < 0.15
    assert min(weights) > 0.3
    assert min(class_slot_weight(model, labels, tokens)) > 0.3  # on other tokens too
    # the class now moves the last position's logits more than in the plain model (2x here)
    def class_effect(m: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = m.forward_sequence(torch.arange(10), tokens[:1].expand(10, -1)).logits[:, -1].float()
        return (logits - logits.mean(0)).abs().mean().item()

    assert class_effect(model) > 1.5 * class_effect(plain)


def test_class_reading_heads_need_a_class_conditional_target() -> None:
    t2i = build_target("GPT-B", seed=0, **{**TINY, "model_type": "t2i", "caption_dim": 16, "cls_token_num": 2})
    with pytest.raises(ValueError, match="c2i"):
        init_class_reading_heads(t2i)
