"""Draft trees: masks, depths and children against brute force, and the builders' shapes."""

import random

import pytest
import torch

from specimg.config import Sampling, TreeConfig
from specimg.errors import SpecimgError
from specimg.testing.markov import MarkovDrafter
from specimg import stalls
from specimg.tree import BatchSession, DraftSession, DraftTree, build_dynamic, build_dynamic_batch, build_tree, stack_trees


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def brute_ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_mask_depths_and_children_match_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    parents = random_parents(n, rng)
    tree = DraftTree.from_parents([rng.randrange(100) for _ in range(n)], parents)
    for i in range(n):
        ancestors = brute_ancestors(parents, i)
        assert set(torch.nonzero(tree.mask[i]).flatten().tolist()) == ancestors
        assert tree.depths[i] == len(ancestors) - 1
        assert list(tree.children[i]) == [j for j in range(n) if parents[j] == i]


def test_candidates_matrix_lists_children_in_order():
    tree = DraftTree.from_parents([5, 7, 8, 9, 1], [-1, 0, 0, 1, 1])
    tokens, ids = tree.candidates()
    assert ids.tolist() == [[1, 2], [3, 4], [-1, -1], [-1, -1], [-1, -1]]
    assert tokens.tolist() == [[7, 8], [9, 1], [-1, -1], [-1, -1], [-1, -1]]


@pytest.mark.parametrize("seed", range(5))
def test_a_forest_is_its_trees_one_after_another(seed):
    rng = random.Random(seed)
    trees = []
    for _ in range(rng.randrange(1, 5)):
        n = rng.randrange(1, 12)
        draft = torch.rand(n, 30)
        trees.append(DraftTree.from_parents([rng.randrange(30) for _ in range(n)], random_parents(n, rng), draft_probs=draft, sampled=True))
    forest = DraftTree.forest(trees)
    assert forest.size == sum(t.size for t in trees) and forest.height == max(t.height for t in trees) and forest.sampled
    for image, (tree, (start, stop)) in enumerate(zip(trees, forest.spans)):
        assert forest.images[start:stop].tolist() == [image] * tree.size
        assert torch.equal(forest.tokens[start:stop], tree.tokens) and torch.equal(forest.depths[start:stop], tree.depths)
        assert forest.parents[start:stop].tolist() == [p + start if p >= 0 else -1 for p in tree.parents.tolist()]
        assert torch.equal(forest.mask[start:stop, start:stop], tree.mask) and forest.mask[start:stop].sum() == tree.mask.sum()
        assert forest.children[start:stop] == tuple(tuple(c + start for c in kids) for kids in tree.children)
        assert torch.equal(forest.draft_probs[start:stop], tree.draft_probs)
    for tree, part in zip(trees, forest.trees()):  # and back, in each tree's own ids (padded to the forest's width and height)
        fields = (*tree_fields(part)[:4], part.children, *tree_fields(part)[6:])
        assert fields == (*tree_fields(tree)[:4], tree.children, *tree_fields(tree)[6:]) and torch.equal(part.mask, tree.mask)
    joined = DraftTree.from_tensors(forest.tokens, forest.parents, forest.depths, forest.logprobs, images=forest.images, sizes=forest.sizes)
    assert torch.equal(joined.mask, forest.mask) and torch.equal(joined.child_ids, forest.child_ids) and joined.spans == forest.spans


@pytest.mark.parametrize("equal", [True, False], ids=["one-size", "ragged"])
def test_a_forest_stacks_as_its_trees(equal):
    """The batch input of a forest (views where its trees have one size) is its trees' stack."""
    rng = random.Random(3)
    sizes = [5, 5, 5] if equal else [5, 2, 7]
    trees = [DraftTree.from_parents([rng.randrange(30) for _ in range(n)], random_parents(n, rng)) for n in sizes]
    forest = DraftTree.forest(trees)
    for got, want in zip(forest.stacked(), stack_trees(trees)):
        assert torch.equal(got, want)
    image, local, slot = forest.places()  # each node's tree and place, and the node at each place
    assert image.tolist() == [i for i, n in enumerate(sizes) for _ in range(n)] and local.tolist() == [k for n in sizes for k in range(n)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert slot.tolist() == [[start + k if k < n else -1 for k in range(max(sizes))] for start, n in zip(starts, sizes)]


def test_rejects_parents_after_children():
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2, 3], [-1, 2, 0])


def session(vocab=12, seed=0):
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    drafter = MarkovDrafter(table)
    drafter.prefill(0, cfg=False)
    root_logits = drafter.start(torch.zeros(1, 1, 4), torch.tensor([3]))
    return DraftSession(drafter, Sampling(), root_logits, root_index=0), table


def test_dynamic_tree_keeps_best_nodes_closed_under_ancestors():
    s, table = session()
    tree = build_tree(s, 3, TreeConfig(depth=4, topk=3, total_tokens=10), max_depth=10)
    assert tree.size == 10
    # every kept node's parent is kept (from_parents would have failed) and scores fall along paths
    scores = [0.0] * tree.size
    for i in range(1, tree.size):
        scores[i] = scores[int(tree.parents[i])] + float(tree.logprobs[i])
        assert scores[i] <= scores[int(tree.parents[i])] + 1e-6
    # root's children are the drafter's best tokens, in rank order
    best = torch.topk(table[3].softmax(-1), 3).indices.tolist()
    assert [int(tree.tokens[c]) for c in tree.children[0]] == best[: len(tree.children[0])]


def test_chain_follows_the_drafters_argmax():
    s, table = session()
    tree = build_tree(s, 3, TreeConfig(kind="chain", depth=5), max_depth=5)
    tokens = [3]
    for _ in range(5):
        tokens.append(int(table[tokens[-1]].argmax()))
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


def test_depth_is_capped_by_the_tokens_still_missing():
    s, _ = session()
    assert build_tree(s, 3, TreeConfig(kind="chain", depth=5), max_depth=2).size == 3
    assert build_tree(s, 3, TreeConfig(), max_depth=0).size == 1


def test_static_tree_takes_ranks_and_validates_paths():
    s, table = session()
    tree = build_tree(s, 3, TreeConfig(kind="static", rank_paths=((0,), (1,), (0, 0), (0, 1), (1, 0))), max_depth=5)
    ranked = torch.argsort(table[3], descending=True).tolist()
    assert [int(tree.tokens[c]) for c in tree.children[0]] == ranked[:2]
    assert tree.size == 6
    with pytest.raises(SpecimgError):
        build_tree(s, 3, TreeConfig(kind="static", rank_paths=((0,), (0, 1))), max_depth=5)


def test_sampled_tree_keeps_every_drawn_child_and_its_draft_distribution():
    s, _ = session()
    tree = build_tree(s, 3, TreeConfig(depth=3, topk=3, total_tokens=13, sample=True), max_depth=5, generator=torch.Generator().manual_seed(1))
    assert tree.sampled and tree.draft_probs is not None and tree.size <= 13
    for node, kids in enumerate(tree.children):
        if kids:
            assert len(kids) == 3
            assert torch.isclose(tree.draft_probs[node].sum(), torch.tensor(1.0))
            assert len({int(tree.tokens[k]) for k in kids}) == 3


def tree_fields(tree: DraftTree) -> tuple:
    return (tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), tree.logprobs.tolist(), tree.child_ids.tolist(),
            tree.height, tree.sampled, None if tree.draft_probs is None else tree.draft_probs.tolist())


@pytest.mark.parametrize("device_form", [False, True], ids=["host", "device"])
@pytest.mark.parametrize(("depth", "topk", "nodes", "sample"), [(4, 3, 10, False), (3, 2, 7, True), (5, 1, 6, False), (2, 4, 20, True), (3, 3, 4, False), (2, 8, 40, False), (2, 8, 40, True)])
def test_a_batch_of_trees_grows_as_each_tree_alone(monkeypatch, device_form, depth, topk, nodes, sample):
    """build_dynamic_batch against build_dynamic image by image: the same trees (nodes,
    log-probs, draft distributions) and, for sampled drafts, the same draws from each
    image's generator; a Markov drafter whose table masks some tokens (drafts of
    probability 0) and CFG guiding only the first tokens."""
    monkeypatch.setattr(stalls, "host_reads_stall", lambda device: device_form)
    vocab, images = 9, 4
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(depth)) * 3
    table[:, :2] = -1e4  # two tokens of probability 0 (drafted only where fewer are left)
    sampling = Sampling(cfg_scale=2.0, cfg_interval=2)
    roots, starts = [1, 4, 1, 7], [0, 1, 5, 2]

    def drafters():
        out = []
        for root in roots:
            drafter = MarkovDrafter(table)
            drafter.prefill(0, cfg=True)
            out.append((drafter, drafter.start(torch.zeros(2, 1, 4), torch.tensor([root]))))
        return out

    alone = []
    for (drafter, root_logits), root, start, seed in zip(drafters(), roots, starts, range(images)):
        session = DraftSession(drafter, sampling, root_logits, root_index=start, filtered=sample)
        alone.append(build_dynamic(session, root, depth, topk, nodes, sample, torch.Generator().manual_seed(seed)))
    together = drafters()

    def expand(parents, tokens):
        return torch.stack([drafter.expand(parents[g], tokens[g]) for g, (drafter, _) in enumerate(together)], dim=1)

    session = BatchSession(expand, sampling, torch.stack([logits for _, logits in together], dim=1), torch.tensor(starts), filtered=sample)
    generators = [torch.Generator().manual_seed(seed) for seed in range(images)]
    batch = build_dynamic_batch(session, torch.tensor(roots), depth, topk, nodes, sample, generators if sample else None)
    for image, (one, grown) in enumerate(zip(alone, batch.trees())):
        assert tree_fields(grown) == tree_fields(one), image
    if sample:  # each generator made the draws it makes alone
        for seed, generator in enumerate(generators):
            alone_generator = torch.Generator().manual_seed(seed)
            session = DraftSession(drafters()[seed][0], sampling, drafters()[seed][1], root_index=starts[seed], filtered=True)
            build_dynamic(session, roots[seed], depth, topk, nodes, True, alone_generator)
            assert torch.equal(generator.get_state(), alone_generator.get_state())
