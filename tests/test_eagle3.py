"""EAGLE-3: the target's exposed layers, training-time test equal to the drafter's own
chains, and its weights (tree expansion, rollback and save/load are in test_eagle.py)."""

from __future__ import annotations

import pytest
import torch

from specimg.errors import SpecimgError
from specimg.models.base import causal_tree_mask
from specimg.models.eagle import build_drafter
from specimg.models.eagle3 import Eagle3Drafter, eagle3_layers
from specimg.models.llamagen import build_target

TINY = dict(dim=64, n_layer=4, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)
ATOL = 1e-5


def test_layer_choice() -> None:
    assert eagle3_layers(12) == (2, 6, 9) and eagle3_layers(36) == (2, 18, 33)
    assert eagle3_layers(4) == (1, 2, 2) and eagle3_layers(1) == (0, 0, 0)


def test_target_exposes_the_inputs_of_its_layers() -> None:
    target = build_target("GPT-B", **TINY)
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(target.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: seen.__setitem__(i, args[0]))
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    assert target.forward_sequence(torch.tensor([3]), tokens).layers is None  # nothing exposed: nothing paid
    target.expose_layers((0, 3, 3))
    whole = target.forward_sequence(torch.tensor([3]), tokens)
    assert whole.layers.shape == (1, 16, 3 * 64)
    torch.testing.assert_close(whole.layers[..., 64:128], seen[3][:, 0:], atol=0, rtol=0)  # cls_token_num = 1: no offset
    torch.testing.assert_close(whole.layers[..., :64], seen[0], atol=0, rtol=0)
    # the cached path gives the same states, prefill's and a tree's
    first = target.prefill(3, cfg=True)
    rest = target.forward_tree(tokens[0, :8], torch.arange(8), causal_tree_mask(8))
    torch.testing.assert_close(torch.cat([first.layers[:1], rest.layers[:1]], dim=1), whole.layers[:, :9], atol=ATOL, rtol=0)
    with pytest.raises(SpecimgError, match="layer 4"):
        target.expose_layers((1, 4))


def test_training_time_test_equals_the_drafters_chains() -> None:
    """Step i's logits at entry j are the drafter's at depth i of a chain below root j,
    drafted with the sequence's own tokens: what the training-time test trains is what
    the drafter does at inference."""
    target = build_target("GPT-B", **TINY)
    drafter = build_drafter(target, seed=1, kind="eagle3")
    assert isinstance(drafter, Eagle3Drafter) and target.exposed == (1, 2, 2)
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    layers = target.forward_sequence(torch.tensor([3]), tokens).layers[:, :-1]
    with torch.no_grad():
        steps = drafter.forward_train(layers, tokens[:, :-1], 3)
    assert len(steps) == 3 and steps[0].shape == (1, 15, 64)
    for root in (0, 5, 12):
        drafter.prefill(3, cfg=False)
        got = [drafter.start(layers[:, : root + 1], tokens[0, : root + 1])]
        got += [drafter.expand(torch.tensor([i - 1]), tokens[0, root + i : root + i + 1])[:, 0] for i in (1, 2)]
        for i, logits in enumerate(got):
            torch.testing.assert_close(logits, steps[i][:, root], atol=ATOL, rtol=0)
    assert not torch.allclose(steps[1][:, 5], steps[0][:, 6], atol=1e-3)  # its own state is no copy of the target's


def test_training_touches_only_the_drafter() -> None:
    target = build_target("GPT-B", **TINY)
    drafter = build_drafter(target, kind="eagle3")
    assert {n for n in dict(drafter.named_parameters()) if not n.startswith("layers.0.")} == {"fc.weight", "norm.weight", "head.weight"}
    assert drafter.fc.weight.shape == (64, 3 * 64)
    steps = drafter.forward_train(torch.randn(2, 5, 3 * 64), torch.randint(0, 64, (2, 5)), 2)
    sum(s.sum() for s in steps).backward()
    assert drafter.head.weight.grad is not None and drafter.fc.weight.grad is not None
    assert target.output.weight.grad is None and target.tok_embeddings.weight.grad is None
