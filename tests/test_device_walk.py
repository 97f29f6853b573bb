"""The acceptance walk as a device program (where a host read stalls: a GPU) against the host
walk, run on the CPU with the device form forced: the same path, next token and generator
state for every tree and draw, and one read of the device a step."""

from __future__ import annotations

import pytest
import torch

import specimg
from specimg import accept, relax, stalls
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.models.vq import build_tokenizer
from specimg.testing import statistics
from specimg.testing.exact import outcomes
from specimg.testing.syncs import counting_host_reads
from specimg.tree import DraftTree

TINY = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=64, num_classes=5, block_size=16)


def random_tree(n: int, vocab: int, g: torch.Generator) -> DraftTree:
    """A random tree whose siblings carry distinct tokens, as every builder's do."""
    parents, tokens, used = [-1], [int(torch.randint(vocab, (), generator=g))], {0: set()}
    for i in range(1, n):
        free = [p for p in range(i) if len(used[p]) < vocab]
        parent = free[int(torch.randint(len(free), (), generator=g))]
        token = [t for t in range(vocab) if t not in used[parent]][int(torch.randint(vocab - len(used[parent]), (), generator=g))]
        used[parent].add(token)
        used[i] = set()
        parents.append(parent)
        tokens.append(token)
    return DraftTree.from_parents(tokens, parents)


@pytest.fixture
def device_form(monkeypatch):
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)


def walk_both(monkeypatch, rule, tree, dist, seed):
    """The host walk's and the device walk's outcomes and generator states after them."""
    outcomes = []
    for forced in (False, True):
        monkeypatch.setattr(stalls, "host_reads_stall", lambda device, forced=forced: forced)
        g = torch.Generator().manual_seed(seed)
        result = rule(tree, dist, g)
        outcomes.append((result, g.get_state()))
    return outcomes


@pytest.mark.parametrize("greedy", [False, True])
def test_the_device_walk_is_the_host_walk(monkeypatch, greedy):
    """Same path and next token, the draws counted alike (the generator ends in the same
    state), and the walked tensors are the path and its new tokens."""
    g = torch.Generator().manual_seed(0)

    def rule(tree, dist, gen):
        return accept.walk_forest(tree, [0], dist, None if greedy else [gen])[0]

    lengths = set()
    for seed in range(150):
        n, vocab = int(torch.randint(1, 12, (), generator=g)), int(torch.randint(2, 5, (), generator=g))
        tree = random_tree(n, vocab, g)
        dist = torch.softmax(3 * torch.randn(n, vocab, generator=g), dim=-1)
        (host, host_state), (device, device_state) = walk_both(monkeypatch, rule, tree, dist, seed)
        assert (device.path, device.next_token) == (host.path, host.next_token), seed
        assert torch.equal(device_state, host_state), seed
        for path, new_tokens, token_list, _ in (host.walked, device.walked):
            assert path.tolist() == host.path
            assert new_tokens.tolist() == token_list == tree.tokens[path[1:]].tolist() + [host.next_token]
        lengths.add(len(host.path))
    assert len(lengths) >= 3  # walks that stop at the root, midway and deep


@pytest.mark.parametrize("form", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("greedy", [False, True])
def test_a_forest_walks_as_each_tree_alone(monkeypatch, greedy, form):
    """A batch's trees walked together (on the host, or in one device program): each
    tree's path, next token, walked tensors and generator state are those of its own walk
    on the host."""
    g = torch.Generator().manual_seed(1)
    for seed in range(60):
        vocab = int(torch.randint(2, 6, (), generator=g))
        trees = [random_tree(int(torch.randint(1, 10, (), generator=g)), vocab, g) for _ in range(int(torch.randint(1, 5, (), generator=g)))]
        forest = DraftTree.forest(trees)
        dist = torch.softmax(3 * torch.randn(forest.size, vocab, generator=g), dim=-1)
        generators = [torch.Generator().manual_seed(seed * 10 + i) for i in range(len(trees))]
        monkeypatch.setattr(stalls, "host_reads_stall", lambda device: form)
        together = accept.walk_forest(forest, [start for start, _ in forest.spans], dist, None if greedy else generators)
        monkeypatch.setattr(stalls, "host_reads_stall", lambda device: False)
        for i, (tree, (start, stop), result) in enumerate(zip(trees, forest.spans, together)):
            own = torch.Generator().manual_seed(seed * 10 + i)
            alone = accept.walk_forest(tree, [0], dist[start:stop], None if greedy else [own])[0]
            assert (result.path, result.next_token) == (alone.path, alone.next_token), (seed, i)
            assert greedy or torch.equal(own.get_state(), generators[i].get_state()), (seed, i)
            path, new_tokens, token_list, _ = result.walked
            assert path.tolist() == alone.path
            assert new_tokens.tolist() == token_list == tree.tokens[path[1:]].tolist() + [alone.next_token]


def sampled_forest(trees: list[DraftTree], vocab: int, g: torch.Generator) -> DraftTree:
    """``trees`` as sampled trees, each node with a random draft distribution, in one forest."""
    return DraftTree.forest([
        DraftTree.from_parents(tree.tokens.tolist(), tree.parents.tolist(), sampled=True,
                               draft_probs=torch.softmax(2 * torch.randn(tree.size, vocab, generator=g), dim=-1))
        for tree in trees
    ])


@pytest.mark.parametrize("rule", ["match", "greedy", "reject"])
def test_a_compiled_walk_is_the_walk_run_directly(monkeypatch, rule):
    """The device walk compiled whole (``fullgraph``, the ``aot_eager`` backend) gives
    every tree's path, next token, walked tensors and generator state of the same walk
    run directly, step after step, with no recompile once each forest shape (its trees'
    sizes, its height, for rejection its widest node's children) was compiled: the
    program reads each step's tensors, none kept from its first run's."""
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    monkeypatch.setenv("SPECIMG_COMPILE_BACKEND", "aot_eager")
    g, vocab = torch.Generator().manual_seed(2), 5
    shapes = [[random_tree(n, vocab, torch.Generator().manual_seed(n)) for n in sizes] for sizes in ((4, 7), (6, 6, 3))]
    lengths, shapes_seen = set(), set()
    for step in range(8):
        trees = [random_tree(tree.size, vocab, g) for tree in shapes[step % 2]]  # new tokens and parents at a compiled shape
        forest = sampled_forest(trees, vocab, g) if rule == "reject" else DraftTree.forest(trees)
        dist = torch.softmax(3 * torch.randn(forest.size, vocab, generator=g), dim=-1)
        roots = [start for start, _ in forest.spans]
        shape = (forest.sizes, forest.height, forest.child_ids.shape[1] if rule == "reject" else None)  # rejection reads the widest node's children
        outcomes = []
        for compiled in (False, True):
            generators = [torch.Generator().manual_seed(100 * step + i) for i in range(len(trees))]
            with torch.compiler.set_stance("fail_on_recompile" if compiled and shape in shapes_seen else "default"):
                if rule == "reject":
                    results = accept.reject_forest(forest, roots, dist, generators, compiled)
                else:
                    results = accept.walk_forest(forest, roots, dist, None if rule == "greedy" else generators, compiled)
            outcomes.append(([(r.path, r.next_token, r.walked.path.tolist(), r.walked.new_tokens.tolist(), r.walked.token_list) for r in results],
                             [generator.get_state() for generator in generators]))
        (direct, direct_states), (compiled_run, compiled_states) = outcomes
        assert compiled_run == direct, step
        assert all(torch.equal(a, b) for a, b in zip(direct_states, compiled_states)), step
        lengths.update(len(path) for path, *_ in direct)
        shapes_seen.add(shape)
    assert len(shapes_seen) < 8 and len(lengths) >= 3


@pytest.mark.parametrize("compiled", [False, True], ids=["direct", "compiled"])
def test_the_device_walk_measures_the_budget_each_path_spent(monkeypatch, compiled):
    """Given p beside a relaxed q_R, the device walk (run directly, or compiled) sums each
    path's TVD of q_R to p in its program: what the engine would measure from the path,
    to double rounding; given q_R as p, it measures nothing."""
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    monkeypatch.setenv("SPECIMG_COMPILE_BACKEND", "aot_eager")
    g, vocab = torch.Generator().manual_seed(3), 5
    for step in range(6):
        forest = DraftTree.forest([random_tree(n, vocab, g) for n in (4, 7, 1)])
        p, q = (torch.softmax(3 * torch.randn(forest.size, vocab, generator=g), dim=-1) for _ in range(2))
        roots = [start for start, _ in forest.spans]
        generators = [torch.Generator().manual_seed(10 * step + i) for i in range(len(roots))]
        results = accept.walk_forest(forest, roots, q, generators, compiled, target_dist=p)
        unmeasured = accept.walk_forest(forest, roots, q, None, compiled, target_dist=q)
        for root, result in zip(roots, results):
            nodes = [root + node for node in result.path]
            torch.testing.assert_close(result.walked.spent, relax.tvd(q[nodes], p[nodes]).sum(), rtol=1e-12, atol=1e-15)
        assert all(result.walked.spent is None for result in unmeasured)


@pytest.fixture(scope="module")
def models():
    target = build_target("GPT-B", seed=0, **TINY)
    return target, build_drafter(target, seed=1), build_tokenizer(seed=2, codebook_size=64, codebook_embed_dim=8)


def generate(models, method: str, sampling: specimg.Sampling):
    """The tokens of two images, and the device reads of each speculative step of the first."""
    target, drafter, tokenizer = models
    engine = specimg.Engine(target, None if method == "ar" else drafter, method, sampling=sampling, tokenizer=tokenizer,
                            tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10))
    with counting_host_reads() as counts:
        first = engine.generate([1], seed=0)
    second = engine.generate([3], seed=1)
    return torch.cat([first.tokens, second.tokens]), sum(counts.values()), len(first.stats.images[0].accepted)


@pytest.mark.parametrize("sampling", [specimg.Sampling(cfg_scale=3.0), specimg.Sampling(cfg_scale=3.0, temperature=0.0)],
                         ids=["sampled", "greedy"])
def test_naive_on_the_device_reproduces_ar_reading_once_a_step(models, device_form, sampling):
    """naive == AR seed for seed with every device form forced, and the host reads the
    device once a step (the walk's outcome), plus the image's first draw (naive relaxes
    nothing, so it has no TVD to read)."""
    ar, _, _ = generate(models, "ar", sampling)
    naive, reads, steps = generate(models, "naive", sampling)
    assert torch.equal(naive, ar)
    assert reads == steps + 1, (reads, steps)


def test_sjd_on_the_device_reads_once_a_step(models, device_form):
    """sjd's window is a sampled chain under the core's recursive rejection: with the
    device forms forced, one read a step (the rejection's outcome) besides the first draw."""
    _, reads, steps = generate(models, "sjd", specimg.Sampling(cfg_scale=3.0))
    assert steps > 1 and reads == steps + 1, (reads, steps)


def test_sjd_gsd_on_the_device_reads_once_a_step(models, device_form):
    """sjd+gsd as published (GSD's group test on sjd's chains, ``chain_acceptance``): with
    the device forms forced, one read a step besides the first draw."""
    _, reads, steps = generate(models, "sjd+gsd", specimg.Sampling(cfg_scale=3.0))
    assert steps > 1 and reads == steps + 1, (reads, steps)


def test_a_checked_relaxation_on_the_device_reads_twice_a_step(models, monkeypatch):
    """cascade+lantern: its checks' verdict and the walk's outcome; the same images as on the CPU path."""
    sampling = specimg.Sampling(cfg_scale=3.0)
    on_cpu, _, _ = generate(models, "cascade+lantern", sampling)
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    on_device, reads, steps = generate(models, "cascade+lantern", sampling)
    assert torch.equal(on_device, on_cpu)
    assert reads == 2 * steps + 2, (reads, steps)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_relaxed_image_books_the_budget_its_device_walks_measured(models, monkeypatch, batch_size):
    """cascade+lantern with the device forms forced books, per image, the budget its walks
    measured in their programs: the CPU path's, to double rounding."""
    target, drafter, tokenizer = models

    def spent(forced: bool) -> list[float]:
        monkeypatch.setattr(stalls, "host_reads_stall", lambda device: forced)
        engine = specimg.Engine(target, drafter, "cascade+lantern", sampling=specimg.Sampling(cfg_scale=3.0), tokenizer=tokenizer,
                                tree=specimg.TreeConfig(kind="dynamic", depth=3, topk=3, total_tokens=10), batch_size=batch_size)
        return [image.tvd for image in engine.generate([1, 3], seed=0).stats.images]

    on_cpu = spent(False)
    assert spent(True) == pytest.approx(on_cpu, rel=1e-9) and min(on_cpu) > 0


def sampled_tree() -> tuple[DraftTree, torch.Tensor]:
    """Root -> tokens 1, 2 (drawn from the root's draft); 1 -> 0, 3; 2 -> 3; with a target
    p that disagrees with the drafts, so that every branch of the rule is taken."""
    draft = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25], [0.0] * 4, [0.0] * 4, [0.0] * 4])
    tree = DraftTree.from_parents([0, 1, 2, 0, 3, 3], [-1, 0, 0, 1, 1, 2], draft_probs=draft, sampled=True)
    p = torch.softmax(torch.randn(6, 4, generator=torch.Generator().manual_seed(3)), dim=-1)
    return tree, p


def exact_law(rule) -> dict[tuple[tuple[int, ...], int], float]:
    """The probability of each (path, next token) of a host rule, by enumerating its draws."""
    law: dict[tuple[tuple[int, ...], int], float] = {}
    for weight, result in outcomes(lambda: rule(torch.Generator().manual_seed(0))):
        key = (tuple(result.path), result.next_token)
        law[key] = law.get(key, 0.0) + weight
    return law


def test_recursive_rejection_on_the_device_follows_the_law_of_the_host_rule(monkeypatch):
    """The device program of recursive rejection draws otherwise than the host (a level
    draws the same whatever happens in it), so its walks are checked against the host
    rule's exact law: 12,000 walks of a forest of copies of one tree, chi-square p-value
    above 1e-6 (a correct rule fails one run in a million).  The same walks reject the
    law of sample-and-match, another exact rule that emits alike but walks otherwise
    (the check has power)."""
    tree, p = sampled_tree()
    copies = 400
    forest = DraftTree.forest([tree] * copies)
    roots = [start for start, _ in forest.spans]
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    counts: dict[tuple[tuple[int, ...], int], int] = {}
    for run in range(30):
        generators = [torch.Generator().manual_seed(run * copies + i) for i in range(copies)]
        for result in accept.reject_forest(forest, roots, p.repeat(copies, 1), generators):
            key = (tuple(result.path), result.next_token)
            counts[key] = counts.get(key, 0) + 1
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: False)
    walks = sum(counts.values())
    for rule, holds in ((lambda g: accept.reject_forest(tree, [0], p, [g])[0], True), (lambda g: accept.walk_forest(tree, [0], p, [g])[0], False)):
        law = exact_law(rule)
        assert set(counts) <= set(law) or not holds
        keys = sorted(set(law) | set(counts))
        observed = torch.tensor([float(counts.get(k, 0)) for k in keys], dtype=torch.float64)
        expected = torch.tensor([walks * law.get(k, 1e-12) for k in keys], dtype=torch.float64)
        assert (statistics.chi_square_pvalue(observed, expected) > 1e-6) == holds


def test_recursive_rejection_on_the_device_leaves_each_generator_after_the_levels_it_walked(monkeypatch):
    """Each tree's generator ends as if it had drawn the levels its walk reached (C uniforms
    and V variates each), not every level of the program: so the image's next draws
    continue its own stream."""
    tree, p = sampled_tree()
    forest = DraftTree.forest([tree] * 20)
    generators = [torch.Generator().manual_seed(i) for i in range(20)]
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    results = accept.reject_forest(forest, [start for start, _ in forest.spans], p.repeat(20, 1), generators)
    assert len({len(result.path) for result in results}) > 1  # walks of different lengths
    for seed, (result, generator) in enumerate(zip(results, generators)):
        replay = torch.Generator().manual_seed(seed)
        for _ in result.path:  # one level per node reached
            torch.empty(2, dtype=torch.float64).uniform_(generator=replay)
            torch.empty(4).exponential_(generator=replay)
        assert torch.equal(replay.get_state(), generator.get_state())
        path, new_tokens, token_list, _ = result.walked
        assert path.tolist() == result.path and new_tokens.tolist() == token_list == tree.tokens[path[1:]].tolist() + [result.next_token]


def sampled_chain() -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
    """Root -> 2 -> 0 -> 3, each node's child accepted with its own probability, and a
    residual per node to emit from where the walk stops (the last node's: its bonus)."""
    chain = DraftTree.from_parents([1, 2, 0, 3], [-1, 0, 1, 2])
    accept_prob = torch.tensor([0.7, 0.45, 0.8, 0.0], dtype=torch.float64)
    residual = torch.tensor([[0.2, 0.0, 0.5, 0.3], [0.0, 0.6, 0.1, 0.3], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    return chain, accept_prob, residual


def test_chain_acceptance_on_the_device_follows_the_law_of_the_host_rule(monkeypatch):
    """The device program of ``chain_acceptance`` (GSD's group test) draws a uniform and V
    variates a level, the host every node's uniform at once: its walks are checked against
    the host rule's exact law, 12,000 walks, chi-square p-value above 1e-6 (a correct rule
    fails one run in a million).  The same walks reject the law of a rule that emits from
    the wrong residual (the check has power)."""
    chain, accept_prob, residual = sampled_chain()
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    counts: dict[tuple[tuple[int, ...], int], int] = {}
    for seed in range(12_000):
        result = accept.chain_acceptance(chain, accept_prob, residual, torch.Generator().manual_seed(seed))
        key = (tuple(result.path), result.next_token)
        counts[key] = counts.get(key, 0) + 1
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: False)
    walks = sum(counts.values())
    wrong = residual.roll(1, dims=0)
    for rows, holds in ((residual, True), (wrong, False)):
        law = exact_law(lambda g, rows=rows: accept.chain_acceptance(chain, accept_prob, rows, g))
        keys = sorted(set(law) | set(counts))
        observed = torch.tensor([float(counts.get(k, 0)) for k in keys], dtype=torch.float64)
        expected = torch.tensor([walks * law.get(k, 1e-12) for k in keys], dtype=torch.float64)
        assert (statistics.chi_square_pvalue(observed, expected) > 1e-6) == holds


def test_chain_acceptance_on_the_device_leaves_the_generator_after_the_levels_it_walked(monkeypatch):
    """The generator ends as if it had drawn the levels the walk reached (a uniform and V
    variates each), and the walked tensors are the path and its new tokens."""
    chain, accept_prob, residual = sampled_chain()
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    lengths = set()
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        result = accept.chain_acceptance(chain, accept_prob, residual, generator)
        replay = torch.Generator().manual_seed(seed)
        for _ in result.path:
            torch.empty(1, dtype=torch.float64).uniform_(generator=replay)
            torch.empty(4).exponential_(generator=replay)
        assert torch.equal(replay.get_state(), generator.get_state()), seed
        path, new_tokens, token_list, _ = result.walked
        assert path.tolist() == result.path and new_tokens.tolist() == token_list == chain.tokens[path[1:]].tolist() + [result.next_token]
        lengths.add(len(result.path))
    assert len(lengths) >= 3
