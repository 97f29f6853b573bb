"""A batch of images drafting in one forward per call: each image's logits are those of
its own drafter alone, whatever the others bring to the call."""

from __future__ import annotations

import pytest
import torch

from specimg.models.eagle import DraftBatch, build_drafter
from specimg.models.llamagen import build_target

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)

# per step: each image's new pairs at start, then per level each image's (parents, tokens) or None
STEPS = [
    ([1, 3, 2], [{0: ([0, 0], [5, 6]), 1: ([0], [7]), 2: ([0, 0, 0], [1, 2, 3])},
                 {0: ([1, 2, 1], [8, 9, 10]), 2: ([2], [4])}]),
    ([2, 1, 3], [{0: ([0], [11]), 1: ([0, 0], [12, 13]), 2: ([0], [14])},
                 {1: ([2], [15])}]),
]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_batched_drafting_is_each_drafter_alone(kind: str, cfg: bool):
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1, kind=kind)
    rows, width = 1 + cfg, drafter.fc.in_features if kind == "eagle3" else TINY["dim"]  # EAGLE-3 lifts fused layers
    alone = [drafter.replica() for _ in range(3)]
    for one in alone:
        one.prefill(0, cfg)
    batch = DraftBatch(drafter, 3, cfg)
    g = torch.Generator().manual_seed(0)
    for news, levels in STEPS:
        requests = {i: (torch.randn(rows, m, width, generator=g), torch.randint(0, 64, (m,), generator=g)) for i, m in enumerate(news)}
        roots = batch.start(requests)
        for i, (hidden, tokens) in requests.items():
            torch.testing.assert_close(roots[i], alone[i].start(hidden, tokens), rtol=0, atol=1e-5)
        for level in levels:
            fed = batch.expand({i: (torch.tensor(p), torch.tensor(t)) for i, (p, t) in level.items()})
            assert set(fed) == set(level)
            for i, (p, t) in level.items():
                torch.testing.assert_close(fed[i], alone[i].expand(torch.tensor(p), torch.tensor(t)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no-cfg"])
def test_every_image_feeding_at_once_is_each_drafter_alone(kind: str, cfg: bool):
    """At fixed shapes (the graph path's arithmetic), ``start`` and ``expand_all`` (every
    image feeds as many nodes: the call a replayed growth makes) give each image its own
    drafter's logits, at mixed cache lengths."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1, kind=kind)
    drafter.set_step_mode("static")
    rows, width = 1 + cfg, drafter.fc.in_features if kind == "eagle3" else TINY["dim"]
    alone = [drafter.replica() for _ in range(3)]
    for one in alone:
        one.prefill(0, cfg)
    batch = DraftBatch(drafter, 3, cfg)
    g = torch.Generator().manual_seed(0)
    for news in ([1, 3, 2], [2, 1, 3]):
        requests = {i: (torch.randn(rows, m, width, generator=g), torch.randint(0, 64, (m,), generator=g)) for i, m in enumerate(news)}
        roots = batch.start(requests)  # at fixed shapes too: padded to a bucket, attending over the whole cache
        for i, (hidden, tokens) in requests.items():
            torch.testing.assert_close(roots[i], alone[i].start(hidden, tokens), rtol=0, atol=1e-5)
        for parents in ([[0, 0], [0, 0], [0, 0]], [[1, 2], [2, 2], [1, 1]]):
            tokens = torch.randint(0, 64, (3, 2), generator=g)
            fed = batch.expand_all(torch.tensor(parents), tokens)
            assert fed.shape == (rows, 3, 2, TINY["vocab_size"])
            for i in range(3):
                torch.testing.assert_close(fed[:, i], alone[i].expand(torch.tensor(parents[i]), tokens[i]), rtol=0, atol=1e-5)
    batch.expand({0: (torch.tensor([0]), torch.tensor([1]))})  # image 0 alone: the counts differ
    with pytest.raises(ValueError, match="every image"):
        batch.expand_all(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long))


def test_a_drafter_that_reads_the_condition_is_refused():
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    drafter.context = 3
    with pytest.raises(ValueError, match="whole condition"):
        DraftBatch(drafter, 2, cfg=False)
