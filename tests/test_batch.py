"""Batched AR: several images per forward, each drawn as it would be alone."""

from __future__ import annotations

import attrs
import pytest
import torch

from specimg import Engine, MethodSpec, Sampling, TreeConfig, accept, costs, hookimpl, stalls
from specimg.costmodel import CostModel
from specimg.engine import ar_tokens
from specimg.errors import SpecimgError
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.models.loading import TINY_VQ
from specimg.models.vq import build_tokenizer
from specimg.models.text_encoder import HashTextEncoder, captions_for_target
from specimg.plugins import PluginManager
from specimg.testing import statistics
from specimg.testing.syncs import counting_host_reads
from specimg_plugins import cascade
from specimg_plugins.cascade import CascadeOptions
from specimg.testing.trees import path_to, random_tree

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
    with pytest.raises(SpecimgError, match="give 1 or more"):
        Engine(target, method="ar", batch_size=0)
    problem = statistics.markov_problem(8, num_tokens=3)
    with pytest.raises(SpecimgError, match="one image at a time"):
        Engine(AloneTarget(problem.target), method="ar", batch_size=2)
    with pytest.raises(SpecimgError, match="one per condition"):
        Engine(target, method="ar").generate([1, 2], seeds=[0])


def test_a_target_without_batched_steps_still_samples_each_image():
    """ar_tokens falls back to one image at a time, with the same seeds."""
    problem = statistics.markov_problem(8, num_tokens=3)
    sampling = statistics.SAMPLING
    assert torch.equal(ar_tokens(problem.target, [0, 0, 0], [5, 6, 7], sampling), one_at_a_time(problem.target, [0, 0, 0], [5, 6, 7], sampling))


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "--model", "tiny-random", "--methods", "ar", "--batch-size", "2,x", "--no-quality"], "sizes such as 1,4,16"),
    (["bench", "--model", "tiny-random", "--methods", "ar", "--batch-size", "0", "--no-quality"], "distinct sizes of 1 or more"),
])
def test_bad_batch_sizes_are_one_line_errors(tmp_path, capsys, args: list[str], message: str):
    from cli_runner import one_line_error

    assert message in one_line_error(capsys, [*args, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", [["-m", "ar"], ["-m", "cascade+lantern", "--tree", "dynamic", "--depth", "3", "--topk", "2", "--total-tokens", "6"]],
                         ids=["ar", "cascade+lantern"])
def test_a_run_continued_with_another_batch_size_keeps_its_images(tmp_path, method: list[str]):
    """generate -n 3 at B = 2, extended to -n 5 at B = 4: the same images as -n 5 at B = 1
    (a speculative method on a fixed tree: auto trees plan with each size's cost model)."""
    import json

    from cli_runner import run

    def tokens(out) -> dict[int, list[int]]:
        entries = [json.loads(line) for line in open(out / "manifest.jsonl") if '"tokens"' in line]
        return {e["seed"]: e["tokens"] for e in entries}

    base = ["generate", "--model", "tiny-random", *method, "--class-labels", "1,2,3,4,5"]
    assert run(*base, "-n", "3", "--batch-size", "2", "--out", str(tmp_path / "b")) == 0
    first = tokens(tmp_path / "b")
    assert run(*base, "-n", "5", "--batch-size", "4", "--out", str(tmp_path / "b")) == 0
    assert run(*base, "-n", "5", "--out", str(tmp_path / "one")) == 0
    assert len(first) == 3 and tokens(tmp_path / "b") == tokens(tmp_path / "one") and all(tokens(tmp_path / "b")[s] == t for s, t in first.items())


def padded(trees: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trees of different sizes as one batch: padded nodes see only themselves."""
    n = max(t.shape[0] for t, _, _ in trees)
    tokens, depths, mask = torch.zeros(len(trees), n, dtype=torch.long), torch.zeros(len(trees), n, dtype=torch.long), torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for i, (t, d, m) in enumerate(trees):
        tokens[i, : t.shape[0]], depths[i, : t.shape[0]], mask[i, : t.shape[0], : t.shape[0]] = t, d, m
    return tokens, depths, mask


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("kind", ["c2i-cfg", "t2i-cfg", "c2i"])
def test_batched_trees_score_as_each_image_alone(kind: str, mode: str):
    """Three images, each its own tree sizes and accepted paths, so their cache lengths part
    after the first step: every real node's logits and states equal those of the image
    verified alone, in both steps (padding and ragged lengths change nothing), eagerly and
    at the fixed shape the compiled path runs (trees padded to a bucket, the whole cache)."""
    target = build_target("GPT-B", seed=2, **(T2I if kind.startswith("t2i") else TINY))
    target.set_step_mode(mode)
    cfg = kind.endswith("cfg")
    conditions = captions_for_target(HashTextEncoder(dim=12), ["a cat", "a long red bus at dawn", "sea"], 5, 12) if kind.startswith("t2i") else [1, 5, 9]
    steps = [[random_tree(n, 64, seed) for n, seed in zip(sizes, seeds)] for sizes, seeds in (([5, 2, 7], [0, 1, 2]), ([3, 6, 1], [3, 4, 5]))]
    paths = [path_to(node, steps[0][i][3]) for i, node in enumerate([4, 0, 6])]

    alone = []
    for i, condition in enumerate(conditions):
        target.prefill(condition, cfg)
        first = target.forward_tree(*steps[0][i][:3])
        target.commit(torch.tensor(paths[i]))
        alone.append((first, target.forward_tree(*steps[1][i][:3])))

    target.prefill_batch(conditions, cfg, tree_nodes=8)
    for step, trees in enumerate(steps):
        out = target.forward_trees(*padded([t[:3] for t in trees]))
        assert out.logits.shape[:3] == (1 + cfg, 3, max(t[0].shape[0] for t in trees))
        for i, tree in enumerate(trees):
            n = tree[0].shape[0]
            torch.testing.assert_close(out.logits[:, i, :n], alone[i][step].logits, rtol=0, atol=1e-5)
            torch.testing.assert_close(out.hidden[:, i, :n], alone[i][step].hidden, rtol=0, atol=1e-5)
        if step == 0:
            target.commit_trees([torch.tensor(p) for p in paths])


def test_tree_steps_refuse_what_does_not_fit():
    target = build_target("GPT-B", seed=0, **TINY)
    target.prefill_batch([1, 2], cfg=False, tree_nodes=4)
    with pytest.raises(ValueError, match="2 images"):
        target.forward_trees(*padded([random_tree(3, 64, 0)[:3]]))
    target.forward_trees(*padded([random_tree(3, 64, 0)[:3], random_tree(2, 64, 1)[:3]]))
    with pytest.raises(ValueError, match="cannot commit 4 nodes"):
        target.commit_trees([torch.arange(4), torch.arange(1)])
    target.commit_trees([torch.tensor([0, 1]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(RuntimeError, match="one length"):
        target.forward_batch(torch.tensor([1, 2]))


# -- speculative decoding in a batch

METHODS = ["naive", "lantern", "cascade+lantern", "gsd", "sjd", "lantern++"]
TREE = TreeConfig(depth=3, topk=2, total_tokens=8)


def lanes_alone(engine: Engine, conditions, seeds) -> list:
    """Each image generated alone by an engine like ``engine`` but at batch size 1."""
    alone = Engine(engine.target, engine.drafter, engine.method, sampling=engine.sampling, tree=engine.tree_config,
                   tokenizer=engine.tokenizer, cost_model=engine.cost_model)
    return [alone.generate([c], seeds=[s]) for c, s in zip(conditions, seeds)]


@pytest.mark.parametrize("method", METHODS)
def test_a_speculative_batch_draws_the_images_of_one_at_a_time(method: str):
    """Five images at batch size 3 (the last batch short), each with its own trees, accepted
    lengths and so cache length: image i is the image of its seed decoded alone, token for
    token, with the same steps (the batched forward rounds as the single one on these tiny
    models; benchmarks/batch_overhead.py counts the tokens that differ on the demo)."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))
    engine = Engine(target, drafter, method, sampling=Sampling(cfg_scale=3.0, top_k=30), tree=TREE, tokenizer=tokenizer, batch_size=3)
    labels, seeds = [3, 7, 3, 0, 9], [5, 6, 7, 40, 2]
    batched = engine.generate(labels, seeds=seeds)
    alone = lanes_alone(engine, labels, seeds)
    assert torch.equal(batched.tokens, torch.cat([a.tokens for a in alone]))
    assert [s.accepted for s in batched.stats.images] == [a.stats.images[0].accepted for a in alone]
    assert len({tuple(s.accepted) for s in batched.stats.images}) > 1  # the images took different steps
    spent = [s.tvd for s in batched.stats.images]  # booked for the whole batch at once; p rounds as float32 in a batch
    assert spent == pytest.approx([a.stats.images[0].tvd for a in alone], rel=1e-5, abs=1e-12)


def test_a_batch_of_sampled_trees_draws_the_images_of_one_at_a_time():
    """Sampled trees under an exact stack (recursive rejection), ragged lengths: each image
    is the one it draws alone, also at the steps where another image of the batch is at
    its last token (its one-node tree has no drafts, so the forest still rejects)."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))
    engine = Engine(target, drafter, "naive", sampling=Sampling(cfg_scale=3.0, top_k=30), tree=attrs.evolve(TREE, sample=True), tokenizer=tokenizer, batch_size=3)
    labels, seeds = [3, 7, 3, 0, 9], [5, 6, 7, 40, 2]
    batched = engine.generate(labels, seeds=seeds)
    alone = lanes_alone(engine, labels, seeds)
    assert torch.equal(batched.tokens, torch.cat([a.tokens for a in alone]))


def test_greedy_naive_in_a_batch_is_greedy_ar():
    target = build_target("GPT-B", seed=0, **TINY)
    greedy = Sampling(temperature=0.0, cfg_scale=3.0)
    labels = [0, 1, 2, 3, 4, 1, 2, 0]
    ar = Engine(target, method="ar", sampling=greedy, batch_size=4).generate(labels, seed=3)
    naive = Engine(target, build_drafter(target, seed=1, kind="eagle3"), "naive", sampling=greedy, tree=TREE, batch_size=4).generate(labels, seed=3)
    assert torch.equal(naive.tokens, ar.tokens)
    assert naive.stats.target_forwards < ar.stats.target_forwards


def test_auto_trees_in_a_batch_plan_per_image_and_may_go_ar():
    """Each image plans with its own planner; an image sent to AR (no tree pays on the
    costly machine, which its first re-plan finds) rides along as one-node trees."""
    target = build_target("GPT-B", seed=0, **dict(TINY, block_size=64))
    drafter = build_drafter(target, seed=1)
    sampling = Sampling(cfg_scale=3.0, top_k=30)
    widths = ((1, 0.01), (10, 0.01))
    costly = CostModel("costly", "a made-up machine", ((1, 1.0), (2, 50.0), (128, 6400.0)), widths, widths, 0.01, 0.0, 1.0)
    for model, goes_ar in ((statistics.flat_costs(), False), (costly, True)):
        engine = Engine(target, drafter, "naive", sampling=sampling, cost_model=model, batch_size=4)
        batched = engine.generate([1, 2, 3, 4], seed=8)
        assert torch.equal(batched.tokens, torch.cat([a.tokens for a in lanes_alone(engine, [1, 2, 3, 4], range(8, 12))]))
        assert [s.trees[-1][3] == 1 for s in batched.stats.images] == [goes_ar] * 4
        assert all(s.tokens == 64 and len(s.tree_sizes) == s.target_forwards - 1 for s in batched.stats.images)


def test_a_batch_plans_with_the_cost_model_measured_at_its_size():
    """The cost model at batch size 2 is measured there (an image's share of a forward over
    two images) and cached under its own key; the stack's step scale comes from a batch."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    engine = Engine(target, drafter, "naive", sampling=Sampling(cfg_scale=3.0, top_k=30), batch_size=2)
    model = engine.prepare(1)
    assert model is not None and model.key == costs.cost_key(target, drafter, engine.sampling, batch=2)[0]
    assert model.key != costs.cost_key(target, drafter, engine.sampling)[0]
    assert costs.scale_key(engine.stack) in model.step_scales
    assert costs.load_or_measure(target, drafter, engine.sampling, 1, batch=2) == model  # cached
    batched = engine.generate([1, 2, 3], seed=0)
    assert torch.equal(batched.tokens, torch.cat([a.tokens for a in lanes_alone(engine, [1, 2, 3], range(3))]))


@pytest.mark.parametrize(("method", "tree"), [("naive", statistics.TREE), ("naive", TreeConfig(sample=True)), ("cascade", TreeConfig())], ids=["topk-tree", "auto-sampled-tree", "cascade-auto"])
def test_the_joint_law_of_a_batch_is_the_ar_law(method: str, tree: TreeConfig):
    """Chi-square against the enumerated AR law of a Markov toy (``statistics.ALPHA`` false
    failures per test), images decoded three at a time: the rows accept different lengths
    step by step."""
    problem = statistics.markov_problem(17)
    engine = Engine(problem.target, problem.drafter, method, sampling=statistics.SAMPLING, tree=tree, tokenizer=problem.tokenizer,
                    cost_model=statistics.flat_costs(), delta=0.0, batch_size=3)
    statistics.check_exact_law(engine, seed=100)


def test_batches_of_speculative_steps_refuse_what_they_cannot_run():
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    with pytest.raises(SpecimgError, match="scores trees itself"):
        Engine(target, drafter, "score-owner", plugins=plugins_with(ScoreOwner()), batch_size=2)

    class OneImageDrafter:
        vocab_size = TINY["vocab_size"]

    with pytest.raises(SpecimgError, match="drafts for a batch"):
        Engine(target, OneImageDrafter(), "naive", batch_size=2)
    problem = statistics.markov_problem(0)
    with pytest.raises(SpecimgError, match="verifies a batch of trees"):
        Engine(OnlyBatchSteps(problem.target), problem.drafter, "naive", batch_size=2)


class ScoreOwner:
    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("score-owner", description="scores trees itself"))

    @hookimpl
    def score(self, target, tree, sampling, token_index):
        return None


def plugins_with(plugin) -> PluginManager:
    plugins = PluginManager()
    plugins.register(plugin, name="score-owner")
    return plugins


class AloneTarget:
    """A target that decodes one image at a time."""

    def __init__(self, inner):
        self.inner, self.vocab_size, self.num_tokens = inner, inner.vocab_size, inner.num_tokens

    def prefill(self, condition, cfg):
        return self.inner.prefill(condition, cfg)

    def forward_tree(self, tokens, depths, mask):
        return self.inner.forward_tree(tokens, depths, mask)

    def commit(self, nodes):
        pass

    def input_embeddings(self):
        return self.inner.input_embeddings()


class OnlyBatchSteps(AloneTarget):
    """A target with batched AR steps but no batched trees."""

    def prefill_batch(self, conditions, cfg, tree_nodes=0):
        return self.inner.prefill_batch(conditions, cfg, tree_nodes)

    def forward_batch(self, tokens):
        return self.inner.forward_batch(tokens)


class FailsOnSecondImage:
    """A method whose proposal fails for the image drawn with seed 1, mid-tree (after its
    drafter calls began), so the other images wait on batched drafter calls meanwhile."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("fails-midway", description="fails on one image"))

    @hookimpl
    def propose_tree(self, session, root_token, tree_config, max_depth, generator):
        from specimg.tree import build_tree

        if generator.initial_seed() == 1:
            session.feed([0], [root_token])  # one level, while the others draft on
            raise SpecimgError("this image's proposal failed")
        return build_tree(session, root_token, tree_config, max_depth, generator)


def test_a_failing_proposal_in_a_batch_raises_and_leaves_no_thread_waiting():
    import threading

    target = build_target("GPT-B", seed=0, **TINY)
    plugins = PluginManager()
    plugins.register(FailsOnSecondImage(), name="fails-midway")
    engine = Engine(target, build_drafter(target, seed=1), "fails-midway", tree=TREE, plugins=plugins, batch_size=3)
    with pytest.raises(SpecimgError, match="proposal failed"):
        engine.generate([1, 2, 3], seed=0)
    done: list[torch.Tensor] = []  # a lane thread left waiting would hold a worker: this batch of 3 would hang
    again = threading.Thread(target=lambda: done.append(engine.generate([1, 2, 3], seed=5).tokens), daemon=True)
    again.start()
    again.join(timeout=60)
    assert done and done[0].shape == (3, 16)


@pytest.mark.parametrize("kind", ["c2i-cfg", "t2i-cfg"])
def test_a_refilled_image_scores_as_alone_and_its_neighbours_are_untouched(kind: str):
    """Image 0 of two finishes after one step and a new condition takes its place: the new
    image's prefill and next tree, and image 1's next tree, equal each verified alone."""
    target = build_target("GPT-B", seed=2, **(T2I if kind.startswith("t2i") else TINY))
    conditions = captions_for_target(HashTextEncoder(dim=12), ["a cat", "a long red bus at dawn", "sea"], 5, 12) if kind.startswith("t2i") else [1, 5, 9]
    first, second = (random_tree(n, 64, seed) for n, seed in ((4, 0), (3, 1)))
    kept = path_to(3, first[3])

    target.prefill(conditions[1], True)
    target.forward_tree(*first[:3])
    target.commit(torch.tensor(kept))
    continuing = target.forward_tree(*second[:3])
    fresh_prefill = target.prefill(conditions[2], True)
    fresh = target.forward_tree(*second[:3])

    target.prefill_batch(conditions[:2], True, tree_nodes=8)
    target.forward_trees(*padded([first[:3], first[:3]]))
    target.commit_trees([torch.tensor([0]), torch.tensor(kept)])
    refilled = target.refill(0, conditions[2])
    torch.testing.assert_close(refilled.logits, fresh_prefill.logits, rtol=0, atol=1e-5)
    out = target.forward_trees(*padded([second[:3], second[:3]]))
    torch.testing.assert_close(out.logits[:, 0], fresh.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits[:, 1], continuing.logits, rtol=0, atol=1e-5)


def test_finished_places_are_refilled_and_images_handed_over_as_they_finish():
    """Seven images through a batch of three: each handed to on_image once, when done, with
    the tokens it has alone (so refilled places start clean)."""
    target = build_target("GPT-B", seed=0, **TINY)
    engine = Engine(target, build_drafter(target, seed=1), "cascade", sampling=Sampling(cfg_scale=3.0, top_k=30), tree=TREE, batch_size=3)
    labels, handed = [3, 7, 3, 0, 9, 1, 5], []
    result = engine.generate(labels, seed=20, on_image=lambda i, tokens, stats: handed.append((i, tokens, stats)))
    assert sorted(i for i, _, _ in handed) == list(range(7))
    assert all(torch.equal(tokens, result.tokens[i]) and stats is result.stats.images[i] for i, tokens, stats in handed)
    assert torch.equal(result.tokens, torch.cat([a.tokens for a in lanes_alone(engine, labels, range(20, 27))]))
    assert all(s.wall > 0 and s.tokens == 16 for s in result.stats.images)


@pytest.mark.parametrize("kind", ["c2i", "t2i"])
def test_fixed_shape_batched_ar_steps_are_the_eager_ones(kind: str):
    """The batched AR step at a fixed shape (what the compiled path runs: the length read on
    the device, the whole cache under a mask) gives the eager step's logits, for two
    batches in a row on the same storage (the first batch's slots are never seen)."""
    target = build_target("GPT-B", seed=2, **(T2I if kind == "t2i" else TINY))
    batches = (captions_for_target(HashTextEncoder(dim=12), ["a cat", "a long red bus at dawn"], 5, 12), captions_for_target(HashTextEncoder(dim=12), ["sea", "two trams"], 5, 12)) if kind == "t2i" else ([1, 5], [9, 2])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (6, 2), generator=g)

    def run(mode: str) -> list[torch.Tensor]:
        target.set_step_mode(mode)
        out = []
        for conditions in batches:
            out.append(target.prefill_batch(conditions, True).logits)
            out.extend(target.forward_batch(t) for t in tokens)
        return out

    for eager, fixed in zip(run("eager"), run("static")):
        torch.testing.assert_close(fixed, eager, rtol=0, atol=1e-5)
    assert torch.equal(Engine(target, method="ar", sampling=Sampling(cfg_scale=3.0), batch_size=2).generate(batches[0], seed=4).tokens,
                       one_at_a_time(target, batches[0], [4, 5], Sampling(cfg_scale=3.0)))
    target.set_step_mode("eager")


def test_a_batch_keeps_its_device_lengths_in_one_tensor_while_its_store_lives():
    """A compiled batch program reads the images' lengths where they live: a new batch of
    the same shape keeps the tensor (and the storage its programs read), its values brought
    up to date in place after eager steps; a batch of another size makes a new one."""
    target = build_target("GPT-B", seed=2, **TINY)
    target.prefill_batch([1, 5], True, tree_nodes=4)
    starts = target._batch.starts
    target.forward_batch(torch.tensor([3, 4]))  # eager: the lengths move on the host alone
    assert target._batch.device_lengths() is starts and starts.tolist() == target._batch.lengths == [2, 2]
    store = target._batch.store
    target.prefill_batch([9, 2], True, tree_nodes=4)
    assert target._batch.device_lengths() is starts and starts.tolist() == [1, 1] and target._batch.store is store
    target.prefill_batch([9, 2, 4], True, tree_nodes=4)
    assert target._batch.starts is not starts


def test_a_speculative_batch_at_fixed_shapes_draws_the_eager_images():
    """The batch's tree forwards and drafting at the fixed shapes the compiled path runs (the
    engine's step mode on a GPU: the drafter's start padded, every place's forest grown as
    one program) give the images of eager decoding."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))
    runs = []
    for mode in ("eager", "static"):
        target.set_step_mode(mode)
        drafter.set_step_mode(mode)
        engine = Engine(target, drafter, "cascade+lantern", sampling=Sampling(cfg_scale=3.0, top_k=30), tree=TREE, tokenizer=tokenizer, batch_size=3)
        runs.append(engine.generate([3, 7, 3, 0, 9], seed=5).tokens)
    target.set_step_mode("eager")
    drafter.set_step_mode("eager")
    assert torch.equal(*runs)


@pytest.mark.parametrize("sampling", [Sampling(cfg_scale=3.0, top_k=30), Sampling(cfg_scale=3.0, temperature=0.0)], ids=["sampled", "greedy"])
@pytest.mark.parametrize(("method", "reads_a_step"), [("naive", 1), ("cascade+lantern", 2)])
def test_a_batch_on_the_device_reads_it_once_a_step_for_every_image(monkeypatch, sampling: Sampling, method: str, reads_a_step: int):
    """With the device forms forced (a GPU's), every image's walk is one device program
    and the batch's host reads do not grow with its images: the walks' outcome once a step
    (and a checked relaxation's verdict), besides each image's first draw and, where the
    stack relaxes, its TVD.  The images are those of the host walks."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))
    labels, seeds = [3, 7, 3], [5, 6, 7]

    def engine() -> Engine:
        return Engine(target, drafter, method, sampling=sampling, tree=TREE, tokenizer=tokenizer, batch_size=3)

    on_the_host = engine().generate(labels, seeds=seeds)
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    with counting_host_reads() as reads:
        on_the_device = engine().generate(labels, seeds=seeds)
    assert torch.equal(on_the_device.tokens, on_the_host.tokens)
    steps = max(s.target_forwards for s in on_the_device.stats.images) - 1  # the prefill is no step
    reads_an_image = 1 if method == "naive" else 2
    assert sum(reads.values()) == reads_a_step * steps + reads_an_image * len(labels), (dict(reads), steps)


def test_recursive_rejection_in_a_batch_on_the_device_reads_it_once_a_step(monkeypatch):
    """Sampled trees under an exact stack: with the device forms forced, every image's
    recursive rejection is one device program, read once a step for the whole batch (its
    law: tests/test_device_walk.py).  The step's other read is the sampled trees' sizes,
    known only once drawn."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))
    engine = Engine(target, drafter, "naive", sampling=Sampling(cfg_scale=3.0, top_k=30), tree=attrs.evolve(TREE, sample=True), tokenizer=tokenizer, batch_size=3)
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    rejections, reject_forest = [], accept.reject_forest

    def counted(*args, **kwargs):
        with counting_host_reads() as reads:
            results = reject_forest(*args, **kwargs)
        rejections.append((len(results), sum(reads.values())))
        return results

    walks, walk_forest = [], accept.walk_forest
    monkeypatch.setattr(accept, "reject_forest", counted)
    monkeypatch.setattr(accept, "walk_forest", lambda *args, **kwargs: walks.append(1) or walk_forest(*args, **kwargs))  # the last token's one-node trees
    out = engine.generate([3, 7, 3], seeds=[5, 6, 7])
    steps = max(s.target_forwards for s in out.stats.images) - 1  # the prefill is no step
    assert len(rejections) + len(walks) == steps and len(rejections) >= steps - 1
    assert {reads for _, reads in rejections} == {1} and max(trees for trees, _ in rejections) == 3
    assert sum(sum(s.accepted) for s in out.stats.images) > 0  # drafts were accepted


class OneTreeCascade:
    """CASCADE's rule registered without ``batch=True``: a batch calls it tree by tree."""

    def __init__(self):
        self.saw_a_forest = False

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("one-tree-cascade", CascadeOptions, "CASCADE, one tree at a time"))

    @hookimpl
    def build_relaxed_dist(self, dist, target_dist, budget, tree, scores, target, options):
        self.saw_a_forest |= tree.images is not None
        return cascade.build_relaxed_dist(dist=dist, target_dist=target_dist, budget=budget, tree=tree, scores=scores, target=target, options=options)


def test_a_method_without_batch_relaxes_tree_by_tree_in_a_batch():
    """Stacked with a method that takes the batch, a method that does not is called with
    one image's tree at a time, and the images are those of the same rule taking the
    batch (cascade+lantern) and of one image at a time."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    tokenizer = build_tokenizer(seed=2, **dict(TINY_VQ, codebook_size=TINY["vocab_size"]))
    one_tree = OneTreeCascade()
    plugins = PluginManager()
    plugins.register(one_tree, name="one-tree-cascade")
    labels, seeds = [3, 7, 3, 0], [5, 6, 7, 40]
    runs = [
        Engine(target, drafter, method, sampling=Sampling(cfg_scale=3.0, top_k=30), tree=TREE, tokenizer=tokenizer, plugins=plugins, batch_size=size)
        .generate(labels, seeds=seeds)
        for method, size in [("one-tree-cascade", 3), ("one-tree-cascade+lantern", 3), ("cascade+lantern", 3), ("one-tree-cascade+lantern", 1)]
    ]
    assert min(s.tvd for s in runs[0].stats.images) > 0  # the rule relaxed every image
    assert torch.equal(runs[1].tokens, runs[2].tokens) and torch.equal(runs[1].tokens, runs[3].tokens)
    assert not one_tree.saw_a_forest
