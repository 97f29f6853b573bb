"""sjd and sjd+gsd: the conformance kit, the joint law of sjd's images against the
enumerated AR law (chi-square at ``statistics.ALPHA``, with a wrong rejection rule on the
same windows failing the same test: the test has power), greedy AR tokens, and the
command line."""

from __future__ import annotations

import pytest
import torch

from specimg import DraftTree, Engine, MethodSpec, Sampling, SpecimgError, hookimpl
from specimg.eval.bench import tree_label
from specimg.plugins import PluginManager
from specimg.testing import statistics
from specimg.testing.statistics import accept_resampling_from_p
from specimg.testing.conformance import emission, make_conformance_tests
from specimg_plugins import gsd, sjd
from tests.cli_runner import run

TestSJDConformance = make_conformance_tests("sjd", "sjd+gsd")
TestSJDBudgetedGSDConformance = make_conformance_tests("sjd+gsd", options={"gsd": {"mode": "specimg"}})
SAMPLINGS = {"cfg": statistics.SAMPLING, "cfg-topk2": Sampling(cfg_scale=2.0, top_k=2, temperature=0.8)}
PROBLEM = 10
"""The Markov problem: one where the wrong rule below shifts the law by a chi-square
noncentrality of about 950 at 2000 images (measured on 6000), against a critical value of
61.7 (df 26, alpha 1e-4): the test rejects it surely."""


def _sjd(problem: statistics.MarkovProblem, method: str = "sjd", window: int = 2, plugins: PluginManager | None = None, **kwargs) -> Engine:
    return Engine(problem.target, None, method, {method: {"window": window}}, tokenizer=problem.tokenizer, plugins=plugins, **kwargs)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS)
@pytest.mark.parametrize("window", [1, 2])
def test_joint_law_is_the_ar_law(sampling: Sampling, window: int):
    statistics.check_exact_law(_sjd(statistics.markov_problem(PROBLEM), window=window, sampling=sampling), seed=100)


class WrongJacobi:
    """sjd's windows, but a rejection draws the correction from p instead of the residual
    norm(max(p - q, 0)): the classic bug."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("wrong-sjd", sjd.SJDOptions, "a wrong acceptance rule", drafter=False))

    @hookimpl
    def propose_tree(self, root_token, max_depth, previous, generator, options):
        return sjd.jacobi_window(previous, root_token, min(options.window, max_depth), generator, greedy=False)

    @hookimpl
    def accept(self, tree, scores, generator):
        return accept_resampling_from_p(tree, scores, generator)


def test_a_wrong_rejection_rule_fails_the_chi_square_test():
    plugins = PluginManager(autoload=False)
    plugins.register(WrongJacobi(), name="wrong-sjd")
    engine = _sjd(statistics.markov_problem(PROBLEM), "wrong-sjd", plugins=plugins, sampling=statistics.SAMPLING)
    assert statistics.exact_law_pvalue(engine, seed=100) < statistics.ALPHA


@pytest.mark.parametrize("method", ["sjd", "sjd+gsd"])
def test_greedy_tokens_are_ar_tokens_with_a_long_window(method: str):
    greedy = Sampling(temperature=0.0, cfg_scale=3.0, cfg_interval=1)
    for seed in range(20):
        problem = statistics.markov_problem(seed=seed, num_tokens=8)
        ar = Engine(problem.target, method="ar", sampling=greedy).generate([0, 1, 2], seed=seed).tokens
        ours = Engine(problem.target, None, method, {"sjd": {"window": 4}}, sampling=greedy, tokenizer=problem.tokenizer, delta=0.0)
        assert torch.equal(ours.generate([0, 1, 2], seed=seed).tokens, ar), f"seed {seed}"


def test_windows_carry_the_last_step_and_accept_more_than_one_token():
    problem = statistics.markov_problem(PROBLEM, num_tokens=12)
    engine = _sjd(problem, window=4, sampling=statistics.SAMPLING)
    run = engine.generate([0] * 10, seed=0).stats
    assert sum(s.target_forwards for s in run.images) < 10 * 12 and max(run.images[0].tree_sizes) == 5
    assert tree_label(engine) == "sjd's own"


def test_a_drafter_free_method_must_bring_its_tree():
    class NoTree:
        @hookimpl
        def register_methods(self, register):
            register(MethodSpec("notree", drafter=False))

    plugins = PluginManager(autoload=False)
    plugins.register(NoTree(), name="notree")
    with pytest.raises(SpecimgError, match="does not implement propose_tree"):
        Engine(statistics.markov_problem(0).target, None, "notree", plugins=plugins)


def test_cli_generates_with_sjd(tmp_path, capsys):
    assert run("generate", "--model", "tiny-random", "--method", "sjd", "-n", "1", "--out", str(tmp_path / "o")) == 0
    assert "sjd's own" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["specimg", "paper"])
def test_sjd_gsd_without_grouping_is_sjd_seed_for_seed(mode: str):
    problem = statistics.markov_problem(PROBLEM, num_tokens=8)
    runs = [Engine(problem.target, None, m, {"sjd": {"window": 3, "mode": mode, "ar_tail": 0}}, statistics.SAMPLING, delta=0.0, tokenizer=problem.tokenizer)
            for m in ("sjd", "sjd+gsd")]
    assert torch.equal(*(e.generate([0] * 20, seed=4).tokens for e in runs))


# --- sjd+gsd with GSD's own group acceptance (gsd.acceptance=group) -----------------------

GROUP = {"acceptance": "group", "mode": "specimg"}
"""specimg's group acceptance: beside sjd, gsd is otherwise the paper's mode, which refuses the option."""


def _chain(first: int, q: torch.Tensor) -> DraftTree:
    """root -> first, drawn from q; the root's row of draft_probs is q."""
    return DraftTree.from_parents([0, first], [-1, 0], draft_probs=torch.stack([q, torch.zeros_like(q)]), sampled=True)


def _emitted_at_root(p: torch.Tensor, q: torch.Tensor, grouping: bool, options: gsd.GSDOptions) -> torch.Tensor:
    """The law of the token emitted after the root, enumerated over the draft x ~ q and
    accept's draws."""
    law = torch.zeros(p.shape[0], dtype=torch.float64)
    probs = torch.stack([p, p])
    for x in q.nonzero().flatten().tolist():
        tree = _chain(x, q)
        _, joint = emission(lambda g: gsd.group_acceptance(tree, probs, EMBEDDINGS, g, options, grouping), tree, p.shape[0])
        law += float(q[x]) * joint[0]
    return law


EMBEDDINGS = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.9, 0.2], [0.0, 1.0], [-1.0, 0.0]])
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
Q = torch.tensor([0.40, 0.30, 0.05, 0.05, 0.20])


def test_group_acceptance_without_grouping_is_speculative_sampling():
    """Enumerated over the draft and every draw: the emitted token follows p exactly."""
    law = _emitted_at_root(P, Q, grouping=False, options=gsd.GSDOptions(**GROUP))
    assert torch.allclose(law, P.double(), atol=1e-12)


def test_group_acceptance_accepts_with_the_group_ratio():
    """x is accepted with min(1, p(G) / q(G)), G = x and its group (by the same rule as the
    budgeted gsd), and a rejection emits norm(max(0, p - q)); here the groups change what
    is accepted, so the law moves off p (the paper's rule has no budget)."""
    options = gsd.GSDOptions(**GROUP)
    probs = torch.stack([P, P])
    grouped = 0
    for x in range(5):
        donors = gsd.group_donors(probs[:1], torch.tensor([[x]]), EMBEDDINGS, options)[0, 0]
        group = [x] + [t for t in donors.tolist() if t >= 0]
        ratio = min(1.0, float(P[group].sum() / Q[group].sum()))
        grouped += ratio != min(1.0, float(P[x] / Q[x]))
        tree = _chain(x, Q)
        _, joint = emission(lambda g: gsd.group_acceptance(tree, probs, EMBEDDINGS, g, options), tree, 5)
        residual = (P - Q).clamp(min=0).double()
        want = (1 - ratio) * residual / residual.sum()
        want[x] += ratio
        assert torch.allclose(joint[0], want, atol=1e-12), (x, group)
    assert grouped >= 2  # the example has groups that change the ratio
    law = _emitted_at_root(P, Q, grouping=True, options=options)
    assert not torch.allclose(law, P.double(), atol=1e-3)


def test_group_acceptance_at_delta_0_follows_the_ar_law():
    problem = statistics.markov_problem(PROBLEM)
    engine = Engine(problem.target, None, "sjd+gsd", {"sjd": {"window": 2}, "gsd": GROUP}, statistics.SAMPLING, delta=0.0,
                    tokenizer=problem.tokenizer)
    statistics.check_exact_law(engine, seed=100)


def test_group_acceptance_needs_a_chain():
    q = torch.tensor([0.5, 0.5, 0.0])
    tree = DraftTree.from_parents([0, 0, 1], [-1, 0, 0], draft_probs=torch.stack([q, torch.zeros(3), torch.zeros(3)]), sampled=True)
    with pytest.raises(SpecimgError, match="chain of sampled drafts"):
        gsd.group_acceptance(tree, torch.full((3, 3), 1 / 3), torch.eye(3), torch.Generator(), gsd.GSDOptions(**GROUP))


def test_group_acceptance_runs_in_the_engine():
    problem = statistics.markov_problem(PROBLEM, num_tokens=8)
    engine = Engine(problem.target, None, "sjd+gsd", {"sjd": {"window": 3}, "gsd": GROUP}, statistics.SAMPLING, tokenizer=problem.tokenizer)
    out = engine.generate([0] * 4, seed=1)
    assert out.tokens.shape == (4, 8) and torch.equal(out.tokens, engine.generate([0] * 4, seed=1).tokens)
