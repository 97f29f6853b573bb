"""Exactness of the core's speculative decoding, against the enumerated AR law of Markov
toy models: the joint law of all V^T token sequences, tested with Pearson's chi-square at
``statistics.ALPHA`` (1e-4 false failures per test) on ``statistics.IMAGES`` images.  A
deliberately wrong acceptance rule must fail the same test: the test has power."""

from __future__ import annotations

import attrs
import pytest
import torch

from specimg import Engine, MethodSpec, Sampling, TreeConfig, hookimpl
from specimg.plugins import PluginManager
from specimg.testing import statistics
from specimg.testing.statistics import accept_resampling_from_p

TREES = {
    "topk-tree": statistics.TREE,
    "sampled-tree": attrs.evolve(statistics.TREE, sample=True),
    "auto-tree": TreeConfig(),
    "auto-sampled-tree": TreeConfig(sample=True),
}
RUNS = {"ar": ("ar", TREES["topk-tree"]), **{f"naive-{name}": ("naive", tree) for name, tree in TREES.items()}}
SAMPLINGS = {"cfg": statistics.SAMPLING, "cfg-topk2": Sampling(cfg_scale=2.0, top_k=2, temperature=0.8)}
PROBLEM = 17
"""The Markov problem: one where the wrong rule below shifts the law by a chi-square
noncentrality of about 660 (top-k tree) and 360 (sampled tree) at 2000 images (measured on
10000), against a critical value of 61.7 (df 26, alpha 1e-4): the test rejects it surely."""


def _engine(method: str, problem: statistics.MarkovProblem, **kwargs) -> Engine:
    """Auto trees are planned on a made-up machine, so the test draws the same trees anywhere."""
    drafter = None if method == "ar" else problem.drafter
    return Engine(problem.target, drafter, method, tokenizer=problem.tokenizer, cost_model=statistics.flat_costs(), **kwargs)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS)
@pytest.mark.parametrize(("method", "tree"), RUNS.values(), ids=RUNS)
def test_joint_law_is_the_ar_law(method: str, tree: TreeConfig, sampling: Sampling):
    engine = _engine(method, statistics.markov_problem(PROBLEM), tree=tree, sampling=sampling)
    statistics.check_exact_law(engine, seed=100)


@pytest.mark.parametrize("tree", TREES.values(), ids=TREES)
def test_greedy_naive_tokens_are_ar_tokens(tree: TreeConfig):
    greedy = Sampling(temperature=0.0, cfg_scale=3.0, cfg_interval=1)
    for seed in range(40):
        problem = statistics.markov_problem(seed=seed, num_tokens=6)
        ar, naive = (_engine(m, problem, tree=tree, sampling=greedy).generate([0, 1, 2], seed=seed).tokens for m in ("ar", "naive"))
        assert torch.equal(naive, ar), f"seed {seed}"


class ResampleFromP:
    """EAGLE-style rejection at each node's first child, min(1, p(x) / q(x)), but a rejection
    draws the correction from p instead of the residual norm(max(p - q, 0)): the classic bug."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("resample-from-p", description="a wrong acceptance rule"))

    @hookimpl
    def accept(self, tree, scores, generator):
        return accept_resampling_from_p(tree, scores, generator)


@pytest.mark.parametrize("tree", TREES.values(), ids=TREES)
def test_a_wrong_acceptance_rule_fails_the_chi_square_test(tree: TreeConfig):
    plugins = PluginManager(autoload=False)
    plugins.register(ResampleFromP(), name="resample-from-p")
    problem = statistics.markov_problem(PROBLEM)
    engine = Engine(
        problem.target, problem.drafter, "resample-from-p", sampling=statistics.SAMPLING, tree=tree, plugins=plugins,
        cost_model=statistics.flat_costs(),
    )
    assert statistics.exact_law_pvalue(engine, seed=100) < statistics.ALPHA
