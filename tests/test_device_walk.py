"""The acceptance walk as a device program (where a host read stalls: a GPU) against the host
walk, run on the CPU with the device form forced: the same path, next token and generator
state for every tree and draw, and one read of the device a step."""

from __future__ import annotations

import pytest
import torch

import specimg
from specimg import accept, stalls
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.models.vq import build_tokenizer
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
    rule = (lambda tree, dist, gen: accept.greedy(tree, dist)) if greedy else accept.sample_and_match
    lengths = set()
    for seed in range(150):
        n, vocab = int(torch.randint(1, 12, (), generator=g)), int(torch.randint(2, 5, (), generator=g))
        tree = random_tree(n, vocab, g)
        dist = torch.softmax(3 * torch.randn(n, vocab, generator=g), dim=-1)
        (host, host_state), (device, device_state) = walk_both(monkeypatch, rule, tree, dist, seed)
        assert (device.path, device.next_token) == (host.path, host.next_token), seed
        assert torch.equal(device_state, host_state), seed
        for path, new_tokens, token_list in (host.walked, device.walked):
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
            alone = accept.greedy(tree, dist[start:stop]) if greedy else accept.sample_and_match(tree, dist[start:stop], own)
            assert (result.path, result.next_token) == (alone.path, alone.next_token), (seed, i)
            assert greedy or torch.equal(own.get_state(), generators[i].get_state()), (seed, i)
            path, new_tokens, token_list = result.walked
            assert path.tolist() == alone.path
            assert new_tokens.tolist() == token_list == tree.tokens[path[1:]].tolist() + [alone.next_token]


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


def test_a_checked_relaxation_on_the_device_reads_twice_a_step(models, monkeypatch):
    """cascade+lantern: its checks' verdict and the walk's outcome; the same images as on the CPU path."""
    sampling = specimg.Sampling(cfg_scale=3.0)
    on_cpu, _, _ = generate(models, "cascade+lantern", sampling)
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: True)
    on_device, reads, steps = generate(models, "cascade+lantern", sampling)
    assert torch.equal(on_device, on_cpu)
    assert reads == 2 * steps + 2, (reads, steps)
