"""mode=paper for lantern and lantern++: the released code's acceptance on each of its paths
(Lumina-mGPT's on sampled trees, LlamaGen's EAGLE-2 on top-k trees, LlamaGen's static tree
``evaluate_posterior_v1`` for lantern++), held against a separate transcription of the
released rules written here.  At one node, every draw of the children and every draw of
the acceptance is enumerated, so those checks have no false failures; end to end, where
the drafter's Gumbel draws cannot be enumerated, a chi-square test at statistics.ALPHA
(1e-4).  Wrong rules (a residual that keeps x's other neighbours, the core's residual,
another path's residual, specimg's budgeted rules) fail the same checks."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator

import attrs
import pytest
import torch

from specimg import DraftTree, Engine, Sampling, SpecimgError, TreeConfig
from specimg.plugins import PluginManager
from specimg.testing import statistics
from specimg.testing.conformance import emission, step_engine
from specimg.testing.strategies import CodebookTokenizer, RelaxCase
from specimg_plugins import lantern, lantern_pp

POSITIONS = [0.0, 1.0, 2.5, 4.5, 7.0, 10.0]
"""Codes on a line, no two at the same distance from a third: every neighbour order is strict."""
VOCAB = len(POSITIONS)
CODEBOOK = CodebookTokenizer(torch.tensor(POSITIONS, dtype=torch.float64)[:, None])
P = [0.04, 0.06, 0.10, 0.22, 0.18, 0.40]
Q = [0.25, 0.10, 0.30, 0.05, 0.20, 0.10]
"""At the root: for some draws A(x) is empty, for others it holds mass and x is still
rejected at times, and some rejections zero every token r - q exceeds (r then stays)."""
Q_CHILD = [0.40, 0.05, 0.05, 0.30, 0.10, 0.10]
P_CHILD = [0.10, 0.10, 0.35, 0.05, 0.25, 0.15]

Allowance = Callable[[float], float]
"""The most mass A(x) may hold, given r(x)."""

PAPER = {
    "lantern": ({"mode": "paper", "k": 2, "delta": 0.25}, lambda rx: 0.25, "lumina"),
    "lantern-k3": ({"mode": "paper", "k": 3, "delta": 0.1}, lambda rx: 0.1, "lumina"),
    "lantern++": ({"mode": "paper", "k": 3, "lam": 2.0}, lambda rx: (2.0 - 1) * rx, "static"),
    "lantern++-k2": ({"mode": "paper", "k": 2, "lam": 3.0}, lambda rx: (3.0 - 1) * rx, "static"),
}
"""Sampled trees: LANTERN's Lumina-mGPT path, LANTERN++'s static-tree path (evaluate_posterior_v1)."""
TOP_K = {
    "lantern": ({"mode": "paper", "k": 2, "delta": 0.25}, lambda rx: 0.25),
    "lantern-k3": ({"mode": "paper", "k": 3, "delta": 0.1}, lambda rx: 0.1),
    "lantern++": ({"mode": "paper", "k": 2, "lam": 3.0}, lambda rx: (3.0 - 1) * rx),
}
"""Top-k trees: the LlamaGen EAGLE-2 path (q = 1)."""


def line_neighbours(k: int) -> list[list[int]]:
    """Each code's k nearest other codes on the line, nearest first."""
    return [sorted((t for t in range(VOCAB) if t != x), key=lambda t: abs(POSITIONS[t] - POSITIONS[x]))[:k] for x in range(VOCAB)]


def published_law(children: list[int], p: list[float], q: list[float] | None, near: list[list[int]], k: int, allowance: Allowance,
                  path: str = "lumina", zeroed: str = "all", empty: str = "uniform") -> list[float]:
    """The token the released rule emits at a node whose children were drafted in this
    order: each child x, with r the residual so far (p at first), is accepted with
    min(1, (r(x) + r(A(x))) / q(x)), A(x) the longest prefix of x's k nearest
    (``near[x][:k]``) with r(A(x)) <= allowance (``indices`` of the release: the last
    index whose cumulative sum fits); after the last rejection, a draw from r.  On
    rejection, by ``path``:

    - "lumina" (models/ea_model_lumina_mgpt.py): r <- max(0, r - q) with x at 0 and, if
      A(x) is not empty, x's k + 1 nearest at 0 too (``gtp[nearest_latents[x, :k + 1]] =
      0``); q drops x and is renormalised;
    - "eagle2" (models/ea_model_llamagen.py ``evaluate_posterior``, top-k drafts): q(x) = 1,
      r(x) <- 0 and, if A(x) is not empty, x's k + 1 nearest at 0; q is not used (``q`` None);
    - "static" (``evaluate_posterior_v1``): r <- max(0, r - q') with q' the current q whose
      k + 1 nearest of x are 0 if A(x) is not empty (``q[nearest_latents[x, :k + 1]] =
      0``, not renormalised), x itself left in q'; q then drops x (the next sibling's q is
      the drafter's without the earlier siblings, renormalised);

    and r is renormalised, or uniform if nothing is left (``torch.ones_like(gtp)``).
    Wrong rules for the power checks, on "lumina": ``zeroed`` "A" (only x and A(x)),
    "none" (the core's residual), "k" (x and its k nearest, always) or "always" (x and its
    k + 1 nearest, A(x) empty or not); on "eagle2": ``zeroed`` "none" (x alone); ``empty``
    "stay" (r kept when nothing is left)."""
    law, reach, r = [0.0] * len(p), 1.0, list(p)
    q = None if q is None else list(q)
    for x in children:
        hood, mass = [], 0.0
        for t in near[x][:k]:
            if mass + r[t] > allowance(r[x]):
                break
            hood.append(t)
            mass += r[t]
        a = min(1.0, (r[x] + mass) / (1.0 if path == "eagle2" else q[x]))
        law[x] += reach * a
        reach *= 1 - a
        if path == "eagle2":
            left = list(r)
            for t in [x, *near[x][: k + 1]] if hood and zeroed == "all" else [x]:
                left[t] = 0.0
        elif path == "static":
            sub = list(q)
            for t in near[x][: k + 1] if hood else []:
                sub[t] = 0.0
            left = [max(0.0, rt - st) for rt, st in zip(r, sub)]
        else:
            left = [max(0.0, rt - qt) for rt, qt in zip(r, q)]
            zero = {"all": [x, *near[x][: k + 1]] if hood else [x], "A": [x, *hood], "none": [], "k": [x, *near[x][:k]],
                    "always": [x, *near[x][: k + 1]]}[zeroed]
            for t in zero:
                left[t] = 0.0
        if sum(left) > 0:
            r = [t / sum(left) for t in left]
        elif empty == "uniform":
            r = [1.0 / len(r)] * len(r)
        if q is not None:
            q[x] = 0.0
            q = [t / sum(q) for t in q]
    return [lt + reach * rt for lt, rt in zip(law, r)]


def draws(q: list[float], count: int) -> Iterator[tuple[float, list[int]]]:
    """Every ordered draw of ``count`` children without replacement from q, with its probability."""
    for draw in itertools.permutations([t for t in range(len(q)) if q[t] > 0], count):
        weight, left = 1.0, sum(q)
        for t in draw:
            weight, left = weight * q[t] / left, left - q[t]
        yield weight, list(draw)


def step(tokens: list[int], parents: list[int], draft: list[list[float]], probs: list[list[float]]) -> RelaxCase:
    """One step on a sampled tree (draft rows: each node's q, zero for leaves), the codes on the line."""
    tree = DraftTree.from_parents(tokens, parents, draft_probs=torch.tensor(draft, dtype=torch.float64), sampled=True)
    return attrs.evolve(RelaxCase.of(tree, torch.tensor(probs, dtype=torch.float64)), tokenizer=CODEBOOK)


def root_step(children: list[int]) -> RelaxCase:
    zeros = [0.0] * VOCAB
    return step([5, *children], [-1] + [0] * len(children), [Q] + [zeros] * len(children), [P] * (1 + len(children)))


def engine_law(method: str, options: dict, case: RelaxCase) -> torch.Tensor:
    """[n, V]: the probability of reaching each node and then emitting each token, through
    the engine's relaxation fold and accept hook, every draw enumerated."""
    engine = step_engine(method, case, {method: options})
    q = engine.relax(case.tree, case.scores)
    return emission(lambda g: engine.accept(case.tree, q, case.scores, g), case.tree, VOCAB)[1]


def method_of(name: str) -> str:
    return name.split("-")[0]


@pytest.mark.parametrize("name", PAPER)
def test_paper_mode_follows_the_published_law_for_every_draw(name: str):
    options, allowance, path = PAPER[name]
    for _, children in draws(Q, 2):
        got = engine_law(method_of(name), options, root_step(children))[0]
        want = torch.tensor(published_law(children, P, Q, line_neighbours(options["k"] + 1), options["k"], allowance, path), dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-12), (children, got.tolist(), want.tolist())


def top_k_step(children: list[int], p: list[float] = P) -> RelaxCase:
    """The root's children as an EAGLE-2 top-k tree drafts them: no draft distributions."""
    tree = DraftTree.from_parents([5, *children], [-1] + [0] * len(children))
    return attrs.evolve(RelaxCase.of(tree, torch.tensor([p] * (1 + len(children)), dtype=torch.float64)), tokenizer=CODEBOOK)


@pytest.mark.parametrize("name", TOP_K)
def test_paper_mode_on_a_top_k_tree_follows_the_eagle2_law(name: str):
    """Every ordered pair and triple of children (a top-k tree's rank order), every draw of
    the acceptance enumerated; and the sampled trees' rule (here with q uniform) is not it."""
    options, allowance = TOP_K[name]
    near, k = line_neighbours(options["k"] + 1), options["k"]
    gaps = []
    for children in [*itertools.permutations(range(VOCAB - 1), 2), (3, 4, 2), (0, 1, 2)]:
        got = engine_law(method_of(name), options, top_k_step(list(children)))[0]
        want = torch.tensor(published_law(list(children), P, None, near, k, allowance, "eagle2"), dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-12), (children, got.tolist(), want.tolist())
        wrong = published_law(list(children), P, [1 / VOCAB] * VOCAB, near, k, allowance, "lumina")
        gaps.append(max(abs(a - b) for a, b in zip(wrong, want.tolist())))
    assert max(gaps) > 0.01


@pytest.mark.parametrize("name", PAPER)
def test_paper_mode_walks_on_with_each_node_its_own_law(name: str):
    """Root -> children 2, 4; 2 -> children 0, 3 (drawn from its own q): the law after
    node 2 is the published law there, times the chance of accepting 2 at the root."""
    options, allowance, path = PAPER[name]
    zeros = [0.0] * VOCAB
    case = step([5, 2, 4, 0, 3], [-1, 0, 0, 1, 1], [Q, Q_CHILD, zeros, zeros, zeros], [P, P_CHILD, P, P, P])
    joint = engine_law(method_of(name), options, case)
    near, k = line_neighbours(options["k"] + 1), options["k"]
    root = published_law([2, 4], P, Q, near, k, allowance, path)
    below = published_law([0, 3], P_CHILD, Q_CHILD, near, k, allowance, path)
    assert root[2] > 0.1
    assert torch.allclose(joint[0], torch.tensor(root, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(joint[1], root[2] * torch.tensor(below, dtype=torch.float64), atol=1e-12)


def average_law(law: Callable[[list[int]], list[float]]) -> torch.Tensor:
    """A node's law over the drafter's draw of its two children."""
    return sum(weight * torch.tensor(law(children), dtype=torch.float64) for weight, children in draws(Q, 2))


def law_gap(name: str, wrong: dict) -> float:
    """The largest difference, over the draws of two children, between the published law
    and a wrong rule's, in configuration ``name``."""
    options, allowance, path = PAPER[name]
    near, k = line_neighbours(options["k"] + 1), options["k"]
    return max(max(abs(a - b) for a, b in zip(published_law(c, P, Q, near, k, allowance, path), published_law(c, P, Q, near, k, allowance, **wrong)))
               for _, c in draws(Q, 2))


@pytest.mark.parametrize("wrong", [{"zeroed": "A"}, {"zeroed": "none"}, {"zeroed": "k"}, {"zeroed": "always"}, {"empty": "stay"}], ids=str)
def test_the_example_tells_the_residuals_apart(wrong: dict):
    """Power: zeroing only x and A(x), nothing (the core's residual), x and its k nearest
    (not k + 1), or the k + 1 nearest even where A(x) is empty, or keeping r where a
    rejection leaves nothing (not uniform): each gives another law for some draw in some
    configuration here, so a plugin computing it would fail the check above."""
    assert max(law_gap(name, {"path": "lumina", **wrong}) for name in PAPER if PAPER[name][2] == "lumina") > 0.01


@pytest.mark.parametrize("name", [name for name in PAPER if PAPER[name][2] == "static"])
def test_zeroing_in_r_is_not_the_static_tree_law(name: str):
    """Power: LANTERN++'s release zeroes the k + 1 nearest in the subtracted q; the same
    codes zeroed in r (the Lumina-mGPT path, specimg's rule before) give another law."""
    assert law_gap(name, {"path": "lumina"}) > 0.01


@pytest.mark.parametrize(("name", "specimg"), [
    ("lantern", {"k": 2, "delta": 0.25, "budget": "candidate", "codebook": "raw"}),
    ("lantern", {"k": 2, "delta": 0.25}),
    ("lantern++", {"k": 3, "lam": 2.0, "delta": 1.0, "codebook": "raw"}),
])
def test_the_budgeted_rules_fail_the_published_law(name: str, specimg: dict):
    """Power: specimg's rules (today's budget per candidate, the per-node budget, lantern++'s
    cap-only transfer) emit another law than the published one, averaged over the draws."""
    options, allowance, path = PAPER[name]
    published = average_law(lambda c: published_law(c, P, Q, line_neighbours(options["k"] + 1), options["k"], allowance, path))
    ours = sum(w * engine_law(name, specimg, root_step(c))[0] for w, c in draws(Q, 2))
    assert float((ours - published).abs().max()) > 0.01


@pytest.mark.parametrize("path", ["lumina", "eagle2"])
def test_a_draft_the_target_masks_is_accepted_as_released(path: str):
    """With p(x) = 0 the release accepts x with r(A(x)) / q(x) (here A(0) = {1, 2} holds
    0.43 <= 0.5: always, against q(0) = 0.25 or q = 1), so the law leaves p's support, and
    the engine's check lets it (paper mode is held to its paper's law)."""
    p = [0.0, 0.30, 0.13, 0.22, 0.15, 0.20]
    zeros = [0.0] * VOCAB
    case = step([5, 0], [-1, 0], [Q, zeros], [p, p]) if path == "lumina" else top_k_step([0], p)
    law = engine_law("lantern", {"mode": "paper", "k": 2, "delta": 0.5}, case)[0]
    want = published_law([0], p, Q if path == "lumina" else None, line_neighbours(3), 2, lambda rx: 0.5, path)
    assert want[0] > 0.4 and torch.allclose(law, torch.tensor(want, dtype=torch.float64), atol=1e-12)


def test_a_rejection_that_leaves_nothing_gives_the_uniform_residual():
    """Under top-k sampling p has few tokens: a rejected draft (3, whose A(3) = {2} holds no
    mass but is not empty) zeroes them all, and the release's residual is uniform over the
    whole vocabulary, outside p's support too (no BudgetError)."""
    p = [0.0, 0.0, 0.0, 0.6, 0.4, 0.0]
    law = engine_law("lantern", {"mode": "paper", "k": 2, "delta": 0.05}, top_k_step([3], p))[0]
    want = published_law([3], p, None, line_neighbours(3), 2, lambda rx: 0.05, "eagle2")
    assert min(want) > 0 and torch.allclose(law, torch.tensor(want, dtype=torch.float64), atol=1e-12)


# --- end to end: the engine on a Markov toy, chi-square at statistics.ALPHA -------------------

SAMPLING = Sampling(cfg_scale=2.0)
"""Guidance on every token: a node's p and q depend on its token alone."""
SAMPLED_TREE = attrs.evolve(statistics.TREE, sample=True)
"""Its first step drafts the root's two children alone (3 tokens an image)."""
END_TO_END = {
    "lantern": ({"mode": "paper", "k": 1, "delta": 0.1}, lambda rx: 0.1, "lumina", SAMPLED_TREE, 3),
    "lantern-top-k": ({"mode": "paper", "k": 1, "delta": 0.1}, lambda rx: 0.1, "eagle2", statistics.TREE, 3),
    "lantern++": ({"mode": "paper", "k": 1, "lam": 3.0}, lambda rx: (3.0 - 1) * rx, "static", SAMPLED_TREE, 5),
}
"""options, allowance, the released path, the run's tree (lantern++ draws its own:
mc_sim_7b_63, whose 4 root children a vocabulary of 5 leaves room to choose), vocabulary."""


def second_tokens(method: str, options: dict, tree: TreeConfig, vocab: int, seed: int = 30) -> tuple[torch.Tensor, dict[int, tuple]]:
    """Images of 3 tokens: the counts of (first, second) token pairs [V * V], the second
    drawn at the root of the first step, and at each root token the drafter's q and the
    number of root children (sampled trees) or the children (top-k trees)."""
    problem = statistics.markov_problem(seed=4, vocab=vocab)
    engine = Engine(problem.target, problem.drafter, method, {method: options}, SAMPLING, tree=tree, tokenizer=problem.tokenizer)
    drafts: dict[int, tuple] = {}

    def record(tree: DraftTree, dist: torch.Tensor, path: list[int]) -> None:
        children = [int(tree.tokens[c]) for c in tree.children[0]]
        if not children:  # the image's last token: nothing drafted
            return
        if tree.draft_probs is None:
            assert drafts.setdefault(int(tree.tokens[0]), (None, children)) == (None, children)  # top-k: always the same
        else:
            drafts.setdefault(int(tree.tokens[0]), (tree.draft_probs[0].double().tolist(), len(children)))

    engine.on_step = record
    tokens = engine.generate([0] * statistics.IMAGES, seed=seed).tokens
    return torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab), drafts


def pair_pvalue(observed: torch.Tensor, drafts: dict[int, tuple], vocab: int, k: int, allowance: Allowance, path: str, zeroed: str = "all") -> float:
    """Pearson's chi-square of the pairs against the published law: the first token by the
    target, the second by the rule at the root, averaged over the drafter's draws of the
    root's children (or its top-k children)."""
    problem = statistics.markov_problem(seed=4, vocab=vocab)
    first, steps = statistics.next_token_laws(problem.target, SAMPLING)
    codes = problem.tokenizer.codebook.tolist()
    near = [sorted((t for t in range(vocab) if t != x), key=lambda t: math.dist(codes[t], codes[x]))[: k + 1] for x in range(vocab)]
    expected = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a in range(vocab):
        q, children = drafts[a]
        for weight, drawn in [(1.0, children)] if q is None else draws(q, children):
            law = published_law(drawn, steps[0, a].tolist(), q, near, k, allowance, path, zeroed)
            expected[a] += float(first[a]) * weight * torch.tensor(law, dtype=torch.float64)
    return statistics.chi_square_pvalue(observed, int(observed.sum()) * expected)


@pytest.mark.parametrize("name", END_TO_END)
def test_paper_mode_end_to_end_follows_the_published_law(name: str):
    """And power at the same sample size: another path's law is rejected."""
    options, allowance, path, tree, vocab = END_TO_END[name]
    observed, drafts = second_tokens(method_of(name), options, tree, vocab)
    assert pair_pvalue(observed, drafts, vocab, options["k"], allowance, path) >= statistics.ALPHA
    wrong = {"lumina": ("lumina", "A"), "eagle2": ("eagle2", "none"), "static": ("lumina", "all")}[path]
    assert pair_pvalue(observed, drafts, vocab, options["k"], allowance, *wrong) < statistics.ALPHA


def test_todays_rule_fails_the_published_law_end_to_end():
    """Power: specimg's budget per candidate (raw codebook) at the same k and delta."""
    options, allowance, path, tree, vocab = END_TO_END["lantern"]
    observed, drafts = second_tokens("lantern", {"k": 1, "delta": 0.1, "budget": "candidate", "codebook": "raw"}, tree, vocab)
    assert pair_pvalue(observed, drafts, vocab, options["k"], allowance, path) < statistics.ALPHA


# --- what paper mode declares and refuses ----------------------------------------------------


@pytest.mark.parametrize("method", ["lantern", "lantern++"])
def test_paper_mode_declares_no_budget(method: str):
    plugins = PluginManager()
    paper = plugins.stack(method, {method: {"mode": "paper"}})
    assert not paper.budgeted and paper.delta == 1.0
    default = plugins.stack(method)
    assert default.budgeted and default.delta == 0.1 and default.members[0].options.mode == "specimg"


def test_paper_mode_keeps_the_published_defaults():
    assert (lantern.LanternOptions().k, lantern.LanternOptions().delta) == (1000, 0.1)
    assert (lantern_pp.LanternPPOptions().k, lantern_pp.LanternPPOptions().lam) == (10, 5.0)


@pytest.mark.parametrize(("method", "unused"), [
    ("lantern", "budget=candidate"), ("lantern", "codebook=raw"), ("lantern", "whole_neighbours=false"),
    ("lantern++", "delta=0.05"), ("lantern++", "codebook=raw"), ("gsd", "acceptance=budget"),
])
def test_an_option_the_paper_mode_ignores_is_refused(method: str, unused: str):
    key, value = unused.split("=")
    with pytest.raises(SpecimgError, match=rf"^{re.escape(method)}.mode=paper does not use {re.escape(method)}.{key}: drop it, or set {re.escape(method)}.mode$"):
        PluginManager().stack(method, {method: {"mode": "paper", key: value}})
    PluginManager().stack(method, {method: {key: value}})  # used outside paper mode


def test_paper_mode_runs_on_the_released_trees():
    """lantern: the release's LlamaGen EAGLE-2 tree where the run leaves the tree to auto (a
    tree the run names is kept); lantern++: mc_sim_7b_63, its drafts drawn from the drafter."""
    problem = statistics.markov_problem(seed=4, vocab=5)

    def tree_of(method: str, options: dict, tree: TreeConfig = TreeConfig()) -> TreeConfig:
        return Engine(problem.target, problem.drafter, method, {method: options}, SAMPLING, tree=tree, tokenizer=problem.tokenizer).tree_config

    released = tree_of("lantern", {"mode": "paper"})
    assert (released.kind, released.depth, released.topk, released.total_tokens, released.sample) == ("dynamic", 4, 10, 59, False)
    assert tree_of("lantern", {"mode": "paper"}, statistics.TREE) == statistics.TREE
    assert tree_of("lantern", {}).kind == "auto"
    static = tree_of("lantern++", {"mode": "paper"})
    assert (static.kind, static.sample, static.rank_paths) == ("static", True, tuple(sorted(lantern_pp.MC_SIM_7B_63, key=lambda p: (len(p), p))))
    paths = lantern_pp.MC_SIM_7B_63
    assert (len(paths), max(map(len, paths)), sum(len(p) == 1 for p in paths)) == (25, 5, 4)


def test_paper_mode_refuses_a_budget_and_delta_0_is_exact():
    case = root_step([2, 4])
    paper = {"lantern": {"mode": "paper", "k": 2}}
    for engine in (step_engine("lantern", case, paper, delta=0.5), step_engine("cascade+lantern", case, {**paper, "cascade": {"delta": 0.5}})):
        with pytest.raises(SpecimgError, match="no TVD budget"):
            engine.relax(case.tree, case.scores)
    assert step_engine("lantern", case, paper, delta=0.0).relax(case.tree, case.scores) is case.p


def test_an_unknown_mode_is_refused():
    for options in (lantern.LanternOptions, lantern_pp.LanternPPOptions):
        with pytest.raises(ValueError):
            options(mode="published")
