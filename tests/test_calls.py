"""The Python counters of specimg.testing.calls: the same count on every run, and nothing
run inside a model's forward counted."""

from __future__ import annotations

from unittest import mock

import pytest

from specimg import Engine, Sampling, TreeConfig
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import LlamaGenTarget, build_target
from specimg.testing.calls import BytecodeCount, CallCount

TINY = dict(dim=32, n_layer=1, n_head=2, vocab_size=32, block_size=9, multiple_of=32, num_classes=4, initializer_range=0.1)


def counted(counter: type[CallCount] | type[BytecodeCount]) -> int:
    """What ``counter`` counts over one speculative decode of a tiny image."""
    target = build_target("GPT-B", seed=0, **TINY)
    engine = Engine(target, build_drafter(target, seed=1), "naive", sampling=Sampling(cfg_scale=2.0, top_k=8), tree=TreeConfig(depth=2, topk=2, total_tokens=4))
    engine.generate([1], seed=3)  # warm: the cost model and first-call caches
    with counter() as count:
        engine.generate([1], seed=0)
    return count.calls if isinstance(count, CallCount) else count.instructions


@pytest.mark.parametrize("counter", [CallCount, BytecodeCount])
def test_a_counter_counts_the_same_on_every_run_and_steps_over_the_forwards(counter):
    plain = counted(counter)
    assert plain > 0 and counted(counter) == plain
    forward = LlamaGenTarget.forward_tree

    def busy(*args, **kwargs):  # a forward with Python work of its own, none of it counted
        sum(range(100))
        [str(i) for i in range(100)]
        return forward(*args, **kwargs)

    with mock.patch.object(LlamaGenTarget, "forward_tree", busy):
        assert counted(counter) == plain
