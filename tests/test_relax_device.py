"""The relaxation step as a device program: on a device where a host read stalls (a GPU),
the stack's relax reads the device once (the contract checks' verdict) or not at all
(checks off), and gives the same q_R as the CPU path.  Run on the CPU with the device
branch forced, counting reads of tensor values and nonzero calls."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specimg import Engine, TreeConfig, stalls
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.models.vq import build_tokenizer
from specimg.testing.syncs import counting_host_reads

TINY = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=64, num_classes=5, block_size=16)
METHODS = ["lantern", "lantern++", "gsd", "cascade", "cascade+lantern", "lantern+gsd"]


@pytest.fixture(scope="module")
def models():
    target = build_target("GPT-B", seed=0, **TINY)
    return target, build_drafter(target, seed=1), build_tokenizer(seed=2, codebook_size=64, codebook_embed_dim=8)


def relaxed_steps(models, method: str, check: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Every step's q_R of one image, and the device reads each relax made."""
    target, drafter, tokenizer = models
    engine = Engine(target, drafter, method, tokenizer=tokenizer, tree=TreeConfig(depth=3, topk=3, total_tokens=10))
    engine.check_relax = check
    outs, reads = [], []
    plain = engine.relax
    nonzero = torch.Tensor.nonzero

    def counted(tree, scores):
        calls: Counter[str] = Counter()

        def counting_nonzero(self, *args, **kwargs):
            calls["nonzero"] += 1
            return nonzero(self, *args, **kwargs)

        torch.Tensor.nonzero = counting_nonzero
        try:
            with counting_host_reads() as host:
                out = plain(tree, scores)
        finally:
            torch.Tensor.nonzero = nonzero
        outs.append(out)
        reads.append(sum(host.values()) + calls["nonzero"])
        return out

    engine.relax = counted
    engine.generate([1], seed=0)
    return outs, reads


@pytest.mark.parametrize("method", METHODS)
def test_relax_reads_the_device_once_for_its_checks_and_matches_the_cpu_path(models, method, monkeypatch):
    cpu_path, _ = relaxed_steps(models, method, check=True)
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    device_path, reads = relaxed_steps(models, method, check=True)
    assert set(reads) == {1}, reads
    assert all(torch.equal(a, b) for a, b in zip(cpu_path, device_path)) and len(cpu_path) == len(device_path)
    _, unchecked = relaxed_steps(models, method, check=False)
    assert set(unchecked) == {0}, unchecked
