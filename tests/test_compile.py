"""The compiled step path on the CPU: the compiler proves every program capturable.

Each built-in method decodes with ``Engine(compile="on")`` and the ``aot_eager`` backend
(the graphs ``torch.compile`` makes, run by eager kernels): every program compiles whole
(``fullgraph=True``: a host read or a graph break is an error), a second decode after the
warm-up compiles nothing new (``fail_on_recompile``), and the tokens are the eager
path's, seed for seed.  A CUDA graph would replay exactly these programs."""

from __future__ import annotations

import pytest
import torch

from specimg import Engine, Sampling, TreeConfig
from specimg.compiled import step_mode
from specimg.errors import SpecimgError
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.models.loading import TINY_VQ
from specimg.models.vq import build_tokenizer

TINY = dict(dim=32, n_layer=1, n_head=2, vocab_size=32, block_size=9, multiple_of=32, num_classes=4, initializer_range=0.1)
METHODS = ["ar", "naive", "lantern", "lantern++", "gsd", "cascade", "cascade+lantern", "sjd", "sjd+gsd"]
TREE = TreeConfig(kind="dynamic", depth=2, topk=2, total_tokens=4)
SAMPLING = Sampling(cfg_scale=2.0, top_k=16)


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    monkeypatch.setenv("SPECIMG_COMPILE_BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def models():
    target = build_target("GPT-B", seed=0, **TINY)
    return target, build_drafter(target, seed=1), build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))


def decode(models, method: str, compile: str, batch: int, sampling: Sampling = SAMPLING) -> torch.Tensor:
    target, drafter, tokenizer = models
    engine = Engine(target, None if method == "ar" else drafter, method, sampling=sampling, tree=TREE, tokenizer=tokenizer, compile=compile,
                    batch_size=batch)
    return engine.generate([0, 1, 2, 3][: max(2, batch)], seed=5).tokens  # two images alone, or a full batch


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_compiles_whole_and_decodes_the_eager_tokens(models, method: str, batch: int):
    eager = decode(models, method, "off", batch)
    assert torch.equal(decode(models, method, "on", batch), eager)  # the warm-up: every shape compiled
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(decode(models, method, "on", batch), eager)


def test_engines_with_other_sampling_on_one_target_each_decode_their_own(models):
    """The compiler's guards hold the sampling a program was compiled for: a second
    engine on the same target with other sampling gets its own distributions, not the
    first one's, and decodes what a fresh eager engine with its sampling decodes."""
    wide, narrow = Sampling(cfg_scale=2.0), Sampling(cfg_scale=2.0, top_k=2)
    for batch in (1, 4):
        first = decode(models, "ar", "on", batch, wide)
        second = decode(models, "ar", "on", batch, narrow)
        assert torch.equal(first, decode(models, "ar", "off", batch, wide))
        assert torch.equal(second, decode(models, "ar", "off", batch, narrow))
        assert not torch.equal(first, second)


def test_compile_follows_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert step_mode("auto", cpu, supported=True) == "eager"
    assert step_mode("auto", cuda, supported=True) == "compiled"
    assert step_mode("auto", cuda, supported=False) == "eager"
    assert step_mode("on", cpu, supported=True) == "compiled"
    assert step_mode("off", cuda, supported=True) == "eager"
    with pytest.raises(SpecimgError, match="needs a target with fixed-shape steps"):
        step_mode("on", cpu, supported=False)
    with pytest.raises(SpecimgError, match="compile must be one of"):
        step_mode("yes", cpu, supported=True)  # type: ignore[arg-type]
