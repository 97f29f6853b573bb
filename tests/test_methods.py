"""The relaxation methods (lantern, lantern++, gsd, cascade) and their stacks, on a toy
world whose target spreads its mass over groups of near-identical tokens."""

from __future__ import annotations

import inspect
import math
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F

from specimg import DraftTree, Engine, MethodSpec, Sampling, SpecimgError, TreeConfig, defaults, hookimpl, neighbours
from specimg.methods import Member, make_options
from specimg.models.vq import build_tokenizer as build_vq
from specimg.plugins import PluginManager
from specimg.relax import transfer, tvd
from specimg.step import Scores
from specimg.testing.conformance import step_engine
from specimg.testing.markov import MarkovDrafter, MarkovTarget
from specimg.testing.strategies import CodebookTokenizer, RelaxCase
from specimg.train.drafter import apply_loss_hooks, loss_hooks, loss_terms, ttt_fold
from specimg.tree import DraftSession, build_tree
from specimg_plugins import cascade, gsd, lantern, lantern_pp

GROUPS, MEMBERS = 6, 4
VOCAB = GROUPS * MEMBERS
TOKENS = 24
METHODS = {"lantern": lantern, "lantern++": lantern_pp, "gsd": gsd, "cascade": cascade}
OPTIONS = {"lantern": lantern.LanternOptions, "lantern++": lantern_pp.LanternPPOptions, "gsd": gsd.GSDOptions, "cascade": cascade.CascadeOptions}


class ToyTokenizer:
    """Stands in for the VQ tokenizer: a vocabulary size and a codebook."""

    def __init__(self, codebook: torch.Tensor):
        self.vocab_size = codebook.shape[0]
        self._codebook = codebook

    def codebook_vectors(self) -> torch.Tensor:
        return self._codebook


def _clustered(dim: int, noise: float, seed: int) -> torch.Tensor:
    """One random unit centre per group, each member a slightly jittered copy."""
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(GROUPS, dim, generator=g), dim=-1).repeat_interleave(MEMBERS, dim=0)
    return centres + noise * torch.randn(VOCAB, dim, generator=g)


def world() -> tuple[MarkovTarget, MarkovDrafter, ToyTokenizer]:
    """After a token of group g the target spreads 90% over group g+1's members (nearly
    uniform) and the rest unevenly (no ties at the top-k cut); the drafter prefers the next group's members m+1 and m+2 after member m, so
    different branches propose different members."""
    group, member = torch.arange(VOCAB) // MEMBERS, torch.arange(VOCAB) % MEMBERS
    background = torch.linspace(1.0, 2.0, VOCAB)
    target = (0.1 * background / background.sum()).repeat(VOCAB, 1)
    draft = torch.full((VOCAB, VOCAB), 0.02)
    for prev in range(VOCAB):
        nxt = (int(group[prev]) + 1) % GROUPS * MEMBERS
        target[prev, nxt : nxt + MEMBERS] = 0.9 * torch.tensor([0.26, 0.25, 0.25, 0.24])
        draft[prev, nxt + (int(member[prev]) + 1) % MEMBERS] = 1.0
        draft[prev, nxt + (int(member[prev]) + 2) % MEMBERS] = 0.6
    first = torch.zeros(VOCAB).fill_(-8.0)
    first[:MEMBERS] = 0.0
    return (
        MarkovTarget(target.log(), first, TOKENS, features=_clustered(16, 0.05, 1)),
        MarkovDrafter(draft.log()),
        ToyTokenizer(_clustered(4, 0.01, 2)),
    )


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path / "cache"))


def one_step(name: str, sampling: Sampling = Sampling(top_k=10)) -> dict[str, Any]:
    """A verified tree from the toy world: everything build_relaxed_dist may ask for."""
    target, drafter, tokenizer = world()
    options = OPTIONS[name]()
    target.prefill(0, sampling.cfg)
    drafter.prefill(0, sampling.cfg)
    session = DraftSession(drafter, sampling, drafter.start(torch.zeros(1, 1, 16), torch.tensor([1])), root_index=0)
    if name == "lantern++":
        tree = lantern_pp.propose_tree(
            session=session, root_token=1, tree_config=TreeConfig(), max_depth=4, generator=torch.Generator(), options=options
        )
    else:
        tree = build_tree(session, 1, TreeConfig(depth=3, topk=3, total_tokens=14), max_depth=3)
    scores = defaults.score(target=target, tree=tree, sampling=sampling, token_index=1)
    return dict(dist=scores.probs, target_dist=scores.probs, tree=tree, scores=scores, target=target, tokenizer=tokenizer, options=options)


def relax(name: str, context: dict[str, Any], budget: float, **options: Any) -> torch.Tensor:
    """Call the method's hook with only the arguments it declares, as pluggy does."""
    hook = METHODS[name].build_relaxed_dist
    context = dict(context, options=attrs.evolve(context["options"], **options))
    context["budget"] = torch.full((context["tree"].size,), budget, dtype=torch.float64)
    return hook(**{k: context[k] for k in inspect.signature(hook).parameters})


def assert_contract(q: torch.Tensor, p: torch.Tensor, tree: DraftTree, delta: float) -> None:
    assert bool((q >= 0).all())
    torch.testing.assert_close(q.sum(-1).double(), torch.ones(tree.size, dtype=torch.float64), atol=1e-5, rtol=0)
    assert not bool(((p == 0) & (q > 0)).any())
    assert bool((tvd(q, p) <= delta + 1e-6).all())
    gain = q.double() - p.double()
    for node, kids in enumerate(tree.children):
        is_candidate = torch.zeros(p.shape[-1], dtype=torch.bool)
        is_candidate[tree.tokens[list(kids)]] = True
        assert bool((gain[node][~is_candidate] <= 1e-7).all()), "a non-candidate gained mass"
        assert bool((gain[node][is_candidate] >= -1e-7).all()), "a candidate lost mass"


@pytest.mark.parametrize("name", METHODS)
def test_relaxation_keeps_the_contract(name):
    context = one_step(name)
    p = context["target_dist"]
    for delta in (0.05, 0.3, 1.0):
        q = relax(name, context, delta, delta=delta)
        assert_contract(q, p, context["tree"], delta)
        assert delta < 0.3 or float(tvd(q, p).max()) > 0.2, "the toy world gives every method something to move"
    assert torch.equal(relax(name, context, 0.0), p)
    assert torch.equal(relax(name, context, 0.3), relax(name, context, 0.3))


@pytest.mark.parametrize("name", ["lantern", "lantern++", "gsd", "cascade"])
def test_relaxed_methods_accept_more_than_naive(name):
    target, drafter, tokenizer = world()
    tree = TreeConfig(depth=5, topk=3, total_tokens=30)  # CASCADE's donors are other branches: a bushy tree
    if name == "lantern++":
        tree = TreeConfig(kind="static", rank_paths=lantern_pp.TREES["small"])

    def run(method: str, options: dict[str, dict[str, Any]] | None = None) -> Any:
        engine = Engine(target, drafter, method=method, options=options, tree=tree, tokenizer=tokenizer)
        return engine.generate([0, 1] * 8, seed=7)

    options = {name: {"delta": 0.5, **({"tree": "small"} if name == "lantern++" else {})}}
    naive, relaxed = run("naive"), run(name, options)
    assert relaxed.tokens.shape == naive.tokens.shape == (16, TOKENS)
    # over 16 images: lantern, lantern++ and gsd gain about 2x here, cascade about 1.2x
    # (the root's children have no other branches to take mass from)
    assert relaxed.stats.tau > 1.1 * naive.stats.tau
    assert torch.equal(run(name, options).tokens, relaxed.tokens)


def test_lantern_whole_neighbours_move_all_or_nothing():
    context = one_step("lantern")
    p = context["target_dist"]
    # group-mates hold ~0.22 each: a 0.1 budget fits no whole neighbour, but 0.1 of one
    assert torch.equal(relax("lantern", context, 0.1, k=3), p)
    partial = relax("lantern", context, 0.1, k=3, whole_neighbours=False)
    inner = [i for i, kids in enumerate(context["tree"].children) if kids]
    torch.testing.assert_close(tvd(partial, p)[inner], torch.full((len(inner),), 0.1, dtype=torch.float64), atol=1e-6, rtol=0)


def test_lantern_needs_a_tokenizer():
    target, drafter, _ = world()
    with pytest.raises(SpecimgError, match="needs the image tokenizer's codebook"):
        Engine(target, drafter, method="lantern").generate([0])


def test_lantern_pp_runs_through_the_engine_with_its_own_tree():
    target, drafter, tokenizer = world()
    for tree in (TreeConfig(ar_fallback=False), TreeConfig(sample=True, ar_fallback=False)):  # drafting, paying or not
        engine = Engine(target, drafter, method="lantern++", options={"lantern++": {"tree": "small"}}, tree=tree, tokenizer=tokenizer)
        out = engine.generate([0], seed=3)
        assert out.tokens.shape == (1, TOKENS)
        assert max(out.stats.images[0].tree_sizes) == 16


def test_lantern_pp_static_trees_and_cap():
    for name, paths in lantern_pp.TREES.items():
        known = set(paths) | {()}
        assert all(p[:-1] in known and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in known) for p in paths), name
    assert len(lantern_pp.TREES["default"]) + 1 == 60
    context = one_step("lantern++")
    tree, p = context["tree"], context["target_dist"]
    assert tree.size == 1 + sum(len(path) <= 4 for path in lantern_pp.TREES["default"])
    q = relax("lantern++", context, 1.0, delta=1.0, lam=1.5)
    candidates = tree.candidates()[0]
    valid = candidates >= 0
    rows = torch.arange(tree.size)[:, None].expand_as(candidates)[valid]
    assert bool((q[rows, candidates[valid]] <= 1.5 * p[rows, candidates[valid]] + 1e-6).all())
    assert torch.equal(relax("lantern++", context, 1.0, lam=1.0), p)
    sampled = lantern_pp.propose_tree(
        session=DraftSession(world()[1], Sampling(), torch.zeros(1, VOCAB), root_index=0), root_token=0,
        tree_config=TreeConfig(sample=True), max_depth=2, generator=torch.Generator().manual_seed(0), options=context["options"],
    )
    assert sampled.sampled and int(sampled.depths.max()) == 2
    with pytest.raises(SpecimgError, match="'tree' must be in"):
        make_options(PluginManager().methods()["lantern++"], {"tree": "nope"})


# --- the papers' modes ------------------------------------------------------------------------

LINE = torch.tensor([[-1.0], [10.0], [20.0], [10.5], [20.5], [30.0]])
"""Codes on a line: 3 is 1's nearest code, 4 is 2's."""


def paper_case(probs: list[float], children: list[int], tokenizer: Any = None) -> RelaxCase:
    """One step: the root (token 5) with ``children`` as leaves, p = ``probs`` at the root."""
    tree = DraftTree.from_parents([5, *children], [-1] + [0] * len(children))
    p = torch.tensor([probs] + [[1 / 6] * 6] * len(children))
    case = RelaxCase.of(tree, p)
    return attrs.evolve(case, tokenizer=tokenizer or CodebookTokenizer(LINE))


def test_lantern_budget_per_candidate_gives_each_candidate_its_own_delta():
    case = paper_case([0.1, 0.2, 0.2, 0.15, 0.15, 0.2], [1, 2])
    options = {"k": 1, "delta": 0.2}
    per_node = step_engine("lantern", case, {"lantern": options}).relax(case.tree, case.scores)
    # one 0.2 for the node: 1 takes 3's 0.15, and 4's 0.15 no longer fits for 2
    torch.testing.assert_close(per_node[0], torch.tensor([0.1, 0.35, 0.2, 0.0, 0.15, 0.2]))
    engine = step_engine("lantern", case, {"lantern": {**options, "budget": "candidate"}})
    per_candidate = engine.relax(case.tree, case.scores)
    # 0.2 each: both move their neighbour, 0.3 in all, more than delta: the method declares 1 for the node
    torch.testing.assert_close(per_candidate[0], torch.tensor([0.1, 0.35, 0.35, 0.0, 0.0, 0.2]))
    assert engine.stack.delta == 1.0
    # a stack budget still bounds the node, and delta 0 is exact
    capped = step_engine("lantern", case, {"lantern": {**options, "budget": "candidate"}}, delta=0.25).relax(case.tree, case.scores)
    torch.testing.assert_close(capped, per_node)
    zero = step_engine("lantern", case, {"lantern": {**options, "budget": "candidate", "delta": 0.0}})
    assert zero.stack.delta == 0.0 and zero.relax(case.tree, case.scores) is case.p


def test_lantern_raw_codebook_takes_neighbours_as_the_released_code_does():
    raw = torch.tensor([[1.0, 0.0], [10.0, 1.0], [0.5, 0.5], [0.0, 2.0], [-2.0, 0.0], [0.3, -3.0]])
    tok = build_vq(codebook_size=6, codebook_embed_dim=2, codebook_l2_norm=True, ch=16, encoder_ch_mult=(1, 2),
                   decoder_ch_mult=(1, 2), num_res_blocks=1, z_channels=16, norm_groups=8)
    with torch.no_grad():
        tok.quantize.embedding.weight.copy_(raw)
    # 0's nearest code: 1 on the unit circle (the same direction), 2 in the raw codebook (L2 0.71 against 9.1)
    case = paper_case([0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [0], tokenizer=tok)
    for codebook, donor in (("normalised", 1), ("raw", 2)):
        q = step_engine("lantern", case, {"lantern": {"k": 1, "delta": 0.3, "codebook": codebook}}).relax(case.tree, case.scores)
        want = case.p[0].clone()
        want[0], want[donor] = 0.4, 0.0
        torch.testing.assert_close(q[0], want)
    assert len(list(neighbours.cache_dir().glob("neighbours-*-k1.pt"))) == 2  # one table per codebook
    with pytest.raises(SpecimgError, match="codebook=raw needs the tokenizer's raw_codebook_vectors"):
        step_engine("lantern", attrs.evolve(case, tokenizer=ToyTokenizer(raw)), {"lantern": {"codebook": "raw"}}).relax(case.tree, case.scores)


def test_lantern_pp_delta_1_is_the_papers_cap_only_rule():
    # 1's neighbours on the line: 3, 2, 4, 0, 5; whole ones while q(1) <= lam * p(1) = 0.3
    case = paper_case([0.3, 0.1, 0.1, 0.05, 0.1, 0.35], [1])
    options = {"k": 10, "lam": 3.0}
    q = step_engine("lantern++", case, {"lantern++": {**options, "delta": 1.0}}).relax(case.tree, case.scores)
    torch.testing.assert_close(q[0], torch.tensor([0.3, 0.25, 0.0, 0.0, 0.1, 0.35]))  # 3 and 2 fit under the cap, 4 does not
    q = step_engine("lantern++", case, {"lantern++": options}).relax(case.tree, case.scores)
    torch.testing.assert_close(q[0], torch.tensor([0.3, 0.15, 0.1, 0.0, 0.1, 0.35]))  # the default budget 0.1 stops at 3


def test_gsd_groups_by_rank_probability_and_embedding():
    probs = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01, 0.0, 0.0]])
    emb = torch.eye(10)
    emb[:, 0] += 2.0  # tokens 0-7 lean the same way ...
    emb[8:, 0] = 0.0
    emb[4] = -emb[4]  # ... except token 4
    candidates = torch.tensor([[2, -1]])
    donors = gsd.group_donors(probs, candidates, emb, gsd.GSDOptions(w=3, p_thr=0.15))
    # 2's rank neighbours, closest first: 1, 3, 0, 4 (opposite embedding), 5 (p gap 0.16)
    assert [t for t in donors[0, 0].tolist() if t >= 0] == [1, 3, 0]
    assert bool((donors[0, 1] == -1).all())
    tight = gsd.group_donors(probs, candidates, emb, gsd.GSDOptions(w=3, p_thr=0.06))
    assert [t for t in tight[0, 0].tolist() if t >= 0] == [1]
    loose = gsd.group_donors(probs, candidates, emb, gsd.GSDOptions(w=3, p_thr=0.2))
    assert [t for t in loose[0, 0].tolist() if t >= 0] == [1, 3, 0, 5]


def test_cascade_donors_come_from_other_branches_and_adjacent_depths():
    # root 0 -> a 1, b 2;  a -> c 3, d 4;  b -> e 5;  c -> f 6
    tree = DraftTree.from_parents([10, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3])
    hidden = torch.zeros(7, 4)
    hidden[:, 3] = 1.0  # unrelated by default
    hidden[3] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # c
    hidden[4] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # d: c's sibling, never a donor
    hidden[5] = torch.tensor([1.0, 0.3, 0.0, 0.0])  # e: other branch, same depth
    hidden[1] = torch.tensor([1.0, 0.1, 0.0, 0.0])  # a: c's parent, depth d
    hidden[6] = torch.tensor([1.0, 0.0, 0.6, 0.0])  # f: c's child, depth d+2, less similar
    ids = tree.candidates()[1]
    donors = cascade.context_donors(tree, hidden, ids, tau_pos=0.9, tau_seq=0.8)
    c_col = tree.children[1].index(3)
    assert [t for t in donors[1, c_col].tolist() if t >= 0] == [11, 15, 16]
    only_pos = cascade.context_donors(tree, hidden, ids, tau_pos=0.9, tau_seq=1.0)
    assert [t for t in only_pos[1, c_col].tolist() if t >= 0] == [15]


def test_cascade_beyond_the_tree_adds_embedding_neighbours_after_the_tree_donors():
    """A chain root -> c: c has no tree donor but its parent (state unrelated here), so only
    the extension gives it mass, from the token nearest c by input embedding."""

    class Target:
        def input_embeddings(self):
            return torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, 1.0], [-1.0, -0.2]])

    tree = DraftTree.from_parents([0, 1], [-1, 0])
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    scores = Scores(p, hidden=torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), logits=torch.zeros(1, 2, 4))
    budget = torch.tensor([0.5, 0.5])
    relax = lambda k: cascade.build_relaxed_dist(p, p, budget, tree, scores, Target(), cascade.CascadeOptions(beyond_tree=k))  # noqa: E731
    assert torch.equal(relax(0), p)
    assert torch.allclose(relax(1)[0], torch.tensor([0.1, 0.5, 0.0, 0.4]))  # token 2, nearest 1, gives its 0.3
    assert torch.allclose(relax(2)[0], torch.tensor([0.0, 0.6, 0.0, 0.4]))  # then token 0, within the budget


def test_cascade_train_loss_boosts_the_cross_entropy_at_convergent_positions():
    # cos(F1, F0) = 0.6, cos(F2, F1) = 0.96, cos(F3, F2) = 0.6 (row 0); row 1: F1 = F0, F2 = F1 but F2 is masked
    features = torch.tensor([
        [[1.0, 0.0], [3.0, 4.0], [4.0, 3.0], [0.0, 5.0]],
        [[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 1.0]],
    ])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)
    soft_ce = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    regression = torch.full((2, 4), 0.5)
    options = cascade.CascadeOptions(tau_seq=0.9, beta=0.5)
    ce, reg = cascade.train_loss(soft_ce=soft_ce, regression=regression, features=features, mask=mask, options=options)
    # convergent: row 0 at t = 2 only; row 1 at t = 1 only (t = 2 and 3 touch the masked position)
    assert ce.tolist() == [[1.0, 2.0, 4.5, 4.0], [1.0, 3.0, 3.0, 4.0]]
    assert reg is regression
    # the per-position loss with EAGLE's weights 0.1 / 1.0, by hand: 0.1 * ce * (1 + 0.5 * convergent) + 0.5
    hooks, _ = loss_hooks(PluginManager(), "cascade", {"cascade": {"tau_seq": 0.9, "beta": 0.5}})
    total = apply_loss_hooks(hooks, soft_ce, regression, 0.1, 1.0, features, torch.zeros(2, 4, dtype=torch.long), mask)
    want = torch.tensor([[0.6, 0.7, 0.95, 0.9], [0.6, 0.8, 0.8, 0.9]])
    torch.testing.assert_close(total, want)


def test_cascade_reweights_each_unrolled_step_of_an_eagle3_drafter():
    # the target's states after consuming tokens 0..3: cos(s1, s0) = 0.6, cos(s2, s1) = 0.96, cos(s3, s2) = 0.6
    features = torch.tensor([[[9.0, 9.0], [1.0, 0.0], [3.0, 4.0], [4.0, 3.0], [0.0, 5.0]]])
    layers, tokens = torch.zeros(1, 5, 6), torch.arange(5)[None]
    uniform = lambda layers, tokens, steps: [torch.zeros(1, 4, 2)] * steps  # noqa: E731  ce = log 2 where valid
    terms = loss_terms(uniform, lambda x: x, layers, features, tokens, steps=2)
    # step i's entry t consumes token t + i and matches s_{t+i}; step 1 has no token to consume at t = 3
    assert terms["mask"].tolist() == [[[True] * 4], [[True, True, True, False]]]
    assert torch.equal(terms["target"][1, 0, :3], features[0, 2:]) and terms["tokens"][1, 0, :3].tolist() == [1, 2, 3]
    hooks, _ = loss_hooks(PluginManager(), "cascade", {"cascade": {"tau_seq": 0.9, "beta": 0.5}})
    parts = apply_loss_hooks(hooks, terms["ce"], terms["reg"], 0.1, 1.0, terms["target"], terms["tokens"], terms["mask"])
    # convergent: step 0 at t = 2 (s2 ~ s1); step 1 at t = 1 (its s2 ~ s1), each step on its own
    log2 = math.log(2)
    torch.testing.assert_close(parts, 0.1 * log2 * torch.tensor([[[1.0, 1.0, 1.5, 1.0]], [[1.0, 1.5, 1.0, 0.0]]]))
    torch.testing.assert_close(ttt_fold(parts, terms["mask"].float()), 0.1 * log2 * torch.tensor([[1.8, 2.2, 2.3, 1.0]]))


def test_cascade_train_loss_leaves_the_regression_alone():
    g = torch.Generator().manual_seed(0)
    features, soft_ce, regression = torch.randn(3, 6, 4, generator=g), torch.rand(3, 6, generator=g), torch.rand(3, 6, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    for options in (cascade.CascadeOptions(tau_seq=-1.0, beta=3.0), cascade.CascadeOptions(tau_seq=1.0, beta=3.0)):
        ce, reg = cascade.train_loss(soft_ce=soft_ce, regression=regression, features=features, mask=mask, options=options)
        assert torch.equal(reg, regression)
    assert torch.equal(ce, soft_ce)  # tau_seq 1: nothing converges (random states)


def test_cascade_training_and_inference_test_convergence_alike():
    """A chain tree's node and its parent are consecutive positions: C(c) holds the parent's
    token exactly where training calls the child's position convergent."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 8, generator=g)
    hidden[2] = hidden[1] + 0.1 * torch.randn(8, generator=g)  # node 2 converges with its parent
    tree = DraftTree.from_parents([10, 11, 12, 13, 14], [-1, 0, 1, 2, 3])
    for tau_seq in (0.0, 0.5, 0.9):
        donors = cascade.context_donors(tree, hidden, tree.candidates()[1], tau_pos=1.0, tau_seq=tau_seq)
        parent_donates = [int(tree.tokens[u]) in donors[u, 0].tolist() for u in range(4)]  # child u+1 takes from u
        convergent = cascade.convergent_positions(hidden[None], torch.ones(1, 5, dtype=torch.bool), tau_seq)[0, 1:].tolist()
        assert parent_donates == convergent


@pytest.mark.parametrize("method", ["cascade+lantern", "lantern+gsd", "naive+cascade"])
def test_stacks_run_end_to_end(method):
    target, drafter, tokenizer = world()
    engine = Engine(target, drafter, method=method, tree=TreeConfig(depth=3, topk=2, total_tokens=8), tokenizer=tokenizer)
    out = engine.generate([0, 1], seed=1)
    assert out.tokens.shape == (2, TOKENS)
    assert engine.stack is not None and engine.stack.delta == max(m.delta for m in engine.stack.members)


@attrs.frozen
class SpendOptions:
    delta: float = 0.05


class SpendAll:
    """Moves exactly its budget at every node with children, from every other token."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("spend", SpendOptions))

    @hookimpl
    def build_relaxed_dist(self, dist, target_dist, budget, tree):
        candidates = tree.candidates()[0]
        donors = torch.arange(dist.shape[-1]).expand(*candidates.shape, -1)
        return transfer(dist, target_dist, candidates, donors, budget)[0]


def test_engine_records_the_budget_spent_at_the_nodes_it_emitted_from():
    target, drafter, _ = world()
    plugins = PluginManager(autoload=False)
    plugins.register(SpendAll(), "spend")
    engine = Engine(target, drafter, "spend", tree=TreeConfig(depth=3, topk=2, total_tokens=8), plugins=plugins)
    walked = []
    engine.on_step = lambda tree, dist, path: walked.append([bool(tree.children[u]) for u in path])
    stats = engine.generate([0], seed=2).stats.images[0]
    inner, emitted = sum(map(sum, walked)), sum(map(len, walked))
    assert inner > 0 and emitted == sum(stats.accepted) + len(stats.accepted)
    # 0.05 at each node with children, 0 at a leaf (no candidates: q_R = p)
    assert stats.tvd == pytest.approx(0.05 * inner / emitted, rel=1e-4)


class DummyTree:
    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("dummytree", description="a second tree supplier"))

    @hookimpl
    def propose_tree(self, root_token):
        return DraftTree.from_parents([root_token], [-1])


def test_lantern_pp_supplies_the_tree():
    pm = PluginManager()
    assert pm.implementers("propose_tree", [Member(pm.methods()["lantern++"], lantern_pp.LanternPPOptions())]) == ["lantern++"]


def test_two_tree_suppliers_are_refused():
    pm = PluginManager()
    pm.register(DummyTree(), "dummytree")
    target, drafter, tokenizer = world()
    with pytest.raises(SpecimgError, match="'dummytree' and 'lantern\\+\\+' both implement 'propose_tree'"):
        Engine(target, drafter, method="dummytree+lantern++", tokenizer=tokenizer, plugins=pm)


def test_a_method_takes_its_defaults_beside_another_and_the_user_overrides_them():
    @attrs.frozen
    class Opts:
        mode: str = "own"
        k: int = 1

    class Pair:
        @hookimpl
        def register_methods(self, register):
            register(MethodSpec("host", drafter=True))
            register(MethodSpec("guest", Opts, stacked_defaults={"host": {"mode": "published"}}))

    plugins = PluginManager(autoload=False)
    plugins.register(Pair(), name="pair")
    assert plugins.stack("guest").options_dict()["guest"] == {"mode": "own", "k": 1}
    assert plugins.stack("host+guest").options_dict()["guest"] == {"mode": "published", "k": 1}
    assert plugins.stack("host+guest", {"guest": {"mode": "own"}}).options_dict()["guest"]["mode"] == "own"


def test_defaults_beside_another_method_must_be_options_the_method_takes():
    class Bad:
        @hookimpl
        def register_methods(self, register):
            register(MethodSpec("bad", lantern.LanternOptions, stacked_defaults={"naive": {"kk": 3}}))

    plugins = PluginManager(autoload=False)
    with pytest.raises(SpecimgError, match="defaults beside 'naive'"):
        plugins.register(Bad(), name="bad")
        plugins.stack("bad")
