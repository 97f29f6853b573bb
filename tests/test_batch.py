"""Batched AR: several images per forward, each drawn as it would be alone."""

from __future__ import annotations

import pytest
import torch

from specimg import Engine, Sampling
from specimg.engine import ar_tokens
from specimg.errors import SpecimgError
from specimg.models.llamagen import build_target
from specimg.models.text_encoder import HashTextEncoder, captions_for_target
from specimg.testing import statistics

TINY = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, block_size=16, multiple_of=32, num_classes=10, initializer_range=0.1)
T2I = dict(TINY, model_type="t2i", cls_token_num=5, caption_dim=12)
SAMPLINGS = [Sampling(cfg_scale=4.0, top_k=20), Sampling(temperature=0.0, cfg_scale=2.0, cfg_interval=4), Sampling(cfg_scale=1.0)]


def one_at_a_time(target, conditions, seeds, sampling) -> torch.Tensor:
    engine = Engine(target, method="ar", sampling=sampling)
    return torch.cat([engine.generate([c], seed=s).tokens for c, s in zip(conditions, seeds)])


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["cfg-topk", "greedy-cfg-interval", "no-cfg"])
def test_a_batch_draws_the_images_of_one_at_a_time(sampling: Sampling):
    """Seven images at batch size 3 (the last batch short): image i is the image of seed
    seed + i decoded alone, token for token (on these tiny models the batched matmuls
    round as the single-row ones do)."""
    target = build_target("GPT-B", seed=0, **TINY)
    labels = [3, 7, 3, 0, 9, 1, 5]
    batched = Engine(target, method="ar", sampling=sampling, batch_size=3).generate(labels, seed=11)
    assert torch.equal(batched.tokens, one_at_a_time(target, labels, range(11, 18), sampling))
    assert [(s.tokens, s.target_forwards) for s in batched.stats.images] == [(16, 16)] * 7


def test_a_t2i_batch_keeps_each_captions_padding():
    target = build_target("GPT-B", seed=0, **T2I)
    texts = ["a red cube", "two dogs on a beach at night", "a bird", "an old green tram"]
    captions = captions_for_target(HashTextEncoder(dim=12), texts, 5, 12)
    assert len({int(c.mask.sum()) for c in captions}) > 1  # the rows are padded differently
    for sampling in (Sampling(cfg_scale=3.0, top_k=20), Sampling(temperature=0.0, cfg_scale=1.0)):
        assert torch.equal(ar_tokens(target, captions, [4, 5, 6, 7], sampling), one_at_a_time(target, captions, [4, 5, 6, 7], sampling))


def test_seeds_are_per_image_whatever_the_batch():
    """Images dealt unevenly (a resumed run's holes, another process's share) keep their seeds."""
    target = build_target("GPT-B", seed=1, **TINY)
    sampling = Sampling(cfg_scale=4.0)
    labels, seeds = [2, 4, 6, 8], [40, 3, 17, 8]
    batched = Engine(target, method="ar", sampling=sampling, batch_size=4).generate(labels, seeds=seeds).tokens
    assert torch.equal(batched, one_at_a_time(target, labels, seeds, sampling))
    assert torch.equal(batched[1:3], Engine(target, method="ar", sampling=sampling, batch_size=2).generate(labels[1:3], seeds=seeds[1:3]).tokens)


def test_progress_counts_every_token_of_every_image():
    target = build_target("GPT-B", seed=0, **TINY)
    counts: list[int] = []
    Engine(target, method="ar", sampling=Sampling(cfg_scale=4.0), batch_size=3).generate([1, 2, 3, 4], progress=counts.append)
    assert sum(counts) == 4 * 16 and set(counts) == {3, 1}


def test_batches_are_refused_where_they_are_not_built():
    target = build_target("GPT-B", seed=0, **TINY)
    with pytest.raises(SpecimgError, match="method 'ar' only"):
        Engine(target, None, "sjd", batch_size=2)
    with pytest.raises(SpecimgError, match="give 1 or more"):
        Engine(target, method="ar", batch_size=0)
    problem = statistics.markov_problem(8, num_tokens=3)
    with pytest.raises(SpecimgError, match="one image at a time"):
        Engine(problem.target, method="ar", batch_size=2)
    with pytest.raises(SpecimgError, match="one per condition"):
        Engine(target, method="ar").generate([1, 2], seeds=[0])


def test_a_target_without_batched_steps_still_samples_each_image():
    """ar_tokens falls back to one image at a time, with the same seeds."""
    problem = statistics.markov_problem(8, num_tokens=3)
    sampling = statistics.SAMPLING
    assert torch.equal(ar_tokens(problem.target, [0, 0, 0], [5, 6, 7], sampling), one_at_a_time(problem.target, [0, 0, 0], [5, 6, 7], sampling))


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--model", "tiny-random", "-m", "naive", "--batch-size", "2"], "method 'ar' only"),
    (["bench", "--model", "tiny-random", "--methods", "ar", "--batch-size", "2,x", "--no-quality"], "sizes such as 1,4,16"),
    (["bench", "--model", "tiny-random", "--methods", "ar", "--batch-size", "0", "--no-quality"], "distinct sizes of 1 or more"),
])
def test_bad_batch_sizes_are_one_line_errors(tmp_path, capsys, args: list[str], message: str):
    from cli_runner import one_line_error

    assert message in one_line_error(capsys, [*args, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_run_continued_with_another_batch_size_keeps_its_images(tmp_path):
    """generate -n 3 at B = 2, extended to -n 5 at B = 4: the same images as -n 5 at B = 1."""
    import json

    from cli_runner import run

    def tokens(out) -> dict[int, list[int]]:
        entries = [json.loads(line) for line in open(out / "manifest.jsonl") if '"tokens"' in line]
        return {e["seed"]: e["tokens"] for e in entries}

    base = ["generate", "--model", "tiny-random", "-m", "ar", "--class-labels", "1,2,3,4,5"]
    assert run(*base, "-n", "3", "--batch-size", "2", "--out", str(tmp_path / "b")) == 0
    first = tokens(tmp_path / "b")
    assert run(*base, "-n", "5", "--batch-size", "4", "--out", str(tmp_path / "b")) == 0
    assert run(*base, "-n", "5", "--out", str(tmp_path / "one")) == 0
    assert len(first) == 3 and tokens(tmp_path / "b") == tokens(tmp_path / "one") and all(tokens(tmp_path / "b")[s] == t for s, t in first.items())
