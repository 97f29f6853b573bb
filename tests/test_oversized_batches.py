"""A --batch-size above the images decodes, plans, calibrates and warms up at the images:
min(batch size, images), which decodes the same images (seeds are per image)."""

import json

import pytest
from cli_runner import run

from specimg import batching, costs
from specimg.engine import Engine

IMAGES = 2


def tokens(out) -> list[list[int]]:
    entries = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    return [e["tokens"] for e in sorted(entries, key=lambda e: e["index"])]


@pytest.fixture
def sizes(monkeypatch):
    """(what, images) of every batch an engine decodes or measures; one above IMAGES fails
    at once (so a broken clamp costs an assertion, not the batch-64 calibration)."""
    seen = []

    def spy(owner, name, size):
        real = getattr(owner, name)

        def recorded(*args, **kwargs):
            seen.append((name, size(*args, **kwargs)))
            assert seen[-1][1] <= IMAGES, seen[-1]
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)

    spy(Engine, "generate", lambda engine, conditions, *_, **__: min(engine.batch_size, len(conditions)))  # warm-up and decoding
    spy(Engine, "_ar", lambda engine, images, *_, **__: len(images))  # AR batches, also calibration's yardstick
    spy(batching, "decode", lambda engine, conditions, *_, **__: min(engine.batch_size, len(conditions)))  # speculative batches, also calibration
    spy(costs, "load_or_measure", lambda *_, batch=1, **__: batch)  # the cost model auto trees plan with
    return seen


@pytest.mark.parametrize(
    "command, same_as",
    [
        (["generate", "-m", "ar"], "1"),  # AR draws each image alike at any batch size
        (["generate", "-m", "naive"], "2"),  # auto trees plan with the cost model of the size decoded
        (["bench", "--methods", "naive", "--no-quality", "--warmup", "1"], "2"),  # AR beside it; both warm up
    ],
    ids=lambda value: " ".join(value[:3]) if isinstance(value, list) else None,
)
def test_a_batch_larger_than_the_images_runs_at_the_images(tmp_path, monkeypatch, sizes, command, same_as):
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path / "cache"))  # the cost model measured in this test, at its size
    args = [*command, "--model", "tiny-random", "-n", str(IMAGES)]
    assert run(*args, "--batch-size", "64", "--out", str(tmp_path / "big")) == 0
    assert ("generate", IMAGES) in sizes
    if "naive" in command:
        assert ("load_or_measure", IMAGES) in sizes and ("decode", IMAGES) in sizes
    if command[0] == "bench":  # each engine warms up on a batch, then decodes one
        assert sizes.count(("generate", IMAGES)) == 4
    assert run(*args, "--batch-size", same_as, "--out", str(tmp_path / "same")) == 0
    assert tokens(tmp_path / "big") == tokens(tmp_path / "same")
