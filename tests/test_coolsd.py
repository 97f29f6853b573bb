"""coolsd (plugins/coolsd.py): the TV bound C1 and its optimal residual checked exactly on
random distributions, the annealed budget C2 spent position by position (C3 by enumerating
the acceptance's draws, C4 on q_R), the AR law at zero relaxation (chi-square at
``statistics.ALPHA``, 1e-4 false failures per test) with a relaxed run failing the same
test, and the conformance kit on its stacks."""

from __future__ import annotations

import pytest
import torch

from specimg import DraftTree, Engine, SpecimgError, TreeConfig
from specimg.relax import tvd
from specimg.testing import statistics
from specimg.testing.conformance import emission, make_conformance_tests, relaxed, step_engine
from specimg.testing.strategies import RelaxCase
from specimg_plugins.coolsd import relaxed_rejection

# the rejection rule on sjd's sampled chains (sjd+coolsd takes acceptance=reject), and the
# default rule after another method's donors
TestCoolSDStacks = make_conformance_tests("sjd+coolsd", "lantern+++coolsd", "coolsd+cascade", examples=10, images=1000)
CHAIN = TreeConfig(kind="chain", depth=2, sample=True)
REJECT = {"coolsd": {"acceptance": "reject"}}


def _random_pair(generator: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a draft q over ``vocab`` tokens, with some zeros in each."""
    p, q = (torch.rand(1, vocab, generator=generator, dtype=torch.float64) ** 3 for _ in range(2))
    p[0, 0], q[0, -1] = 0.0, 0.0
    return p / p.sum(), q / q.sum()


def _output_law(p: torch.Tensor, q: torch.Tensor, accept_prob: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """One position's law: accept the draft x ~ q with a(x), else draw the residual."""
    accepted = q * accept_prob
    rejected = 1 - accepted.sum(-1, keepdim=True)
    return accepted + rejected * residual / residual.sum(-1, keepdim=True).clamp(min=1e-300)


def test_c1_the_optimal_residual_reaches_the_bound_and_no_other_does_better():
    """On 300 random (p, q, budget): with r*, TV(output, p) is exactly the bound
    sum (q a - p)^+ = min(budget, TV(p, q)) and the acceptance rate exactly 1 - TV(p, q) +
    that TV; 20 random residuals each never get below it (C1 says none can)."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        p, q = _random_pair(generator, 2 + trial % 7)
        budget = torch.rand(1, generator=generator, dtype=torch.float64) * (0.05 if trial % 3 == 0 else 1.0)
        accept_prob, residual = relaxed_rejection(p, q, budget)
        law = _output_law(p, q, accept_prob, residual)
        bound = (q * accept_prob - p).clamp(min=0).sum(-1)
        spent = tvd(law, p)
        assert torch.allclose(spent, bound, atol=1e-12) and torch.allclose(spent, torch.minimum(budget, tvd(p, q)), atol=1e-12)
        assert torch.allclose((q * accept_prob).sum(-1), 1 - tvd(p, q) + spent, atol=1e-12)
        others = torch.rand(20, p.shape[-1], generator=generator, dtype=torch.float64)
        assert bool((tvd(_output_law(p, q, accept_prob, others), p) >= spent - 1e-12).all()), f"trial {trial}: a residual beat r*"


def test_c1_a_relaxed_targets_own_residual_spends_more():
    """The residual of the relaxed target (norm(max(0, p~ - q)), as LANTERN resamples) with
    the same acceptance: where p~ exceeds q on a draft, it spends more TVD than r*."""
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.2, 0.6]], dtype=torch.float64)
    relaxed_target = torch.tensor([[0.3, 0.5, 0.2]], dtype=torch.float64)  # mass moved from token 0 onto token 1
    accept_prob = torch.minimum(relaxed_target / q, torch.ones_like(q))
    optimal = (p - q * accept_prob).clamp(min=0)
    own = (relaxed_target - q).clamp(min=0)
    assert float(tvd(_output_law(p, q, accept_prob, optimal), p)) == pytest.approx(0.0)  # q a <= p everywhere: no TVD spent
    assert float(tvd(_output_law(p, q, accept_prob, own), p)) == pytest.approx(0.2)


def _sampled_chain(q: torch.Tensor, tokens: list[int]) -> DraftTree:
    """A chain root -> x1 -> x2 whose node i's child was drawn from q[i]."""
    logprobs = [0.0] + [float(q[i, t].log()) for i, t in enumerate(tokens)]
    return DraftTree.from_parents([0, *tokens], [-1, 0, 1], logprobs, draft_probs=q, sampled=True)


def test_c3_each_position_spends_its_annealed_budget_exactly():
    """The engine's rejection rule on a sampled chain, its draws enumerated and averaged
    over each node's draft: the law emitted after node d is within exactly
    min(delta * decay^d, TV(p_d, q_d)) of p_d, and is C3's output law."""
    generator = torch.Generator().manual_seed(3)
    vocab, delta, decay = 4, 0.3, 0.5
    p = torch.stack([_random_pair(generator, vocab)[0][0] for _ in range(3)]).float()
    q = torch.stack([_random_pair(generator, vocab)[1][0] for _ in range(3)]).float()
    q[2] = 0  # the leaf draws nothing
    options = {"coolsd": {"acceptance": "reject", "delta": delta, "decay": decay}}

    def emitted(first: int, second: int) -> tuple[torch.Tensor, torch.Tensor]:
        case = RelaxCase.of(_sampled_chain(q, [first, second]), p)
        engine = step_engine("coolsd", case, options)
        return emission(lambda g: engine.accept(case.tree, relaxed(engine, case.tree, case.scores), case.scores, g), case.tree, vocab)

    tokens = range(vocab)
    reached = int(q[0].argmax())  # the root's likeliest draft: accepted with probability > 0
    laws = [
        sum(float(q[0, x]) * emitted(x, reached)[1][0] for x in tokens if q[0, x] > 0),  # after the root, over its draft
        sum(float(q[1, x]) * (lambda r, j: j[1] / r[1])(*emitted(reached, x)) for x in tokens if q[1, x] > 0),  # after node 1, given it is reached
    ]
    for depth, law in enumerate(laws):
        budget = torch.tensor([delta * decay**depth], dtype=torch.float64)  # C2, written out
        rule = relaxed_rejection(p[depth : depth + 1].double(), q[depth : depth + 1].double(), budget)
        want = _output_law(p[depth : depth + 1].double(), q[depth : depth + 1].double(), *rule)[0]
        assert torch.allclose(law, want, atol=1e-6), f"node {depth}: {law.tolist()} is not C3's law {want.tolist()}"
        assert float(tvd(law, p[depth])) == pytest.approx(min(float(budget), float(tvd(p[depth], q[depth]))), abs=1e-6)


def test_c4_spends_the_annealed_budget_per_depth_from_every_non_candidate_alike():
    """q_R at node d moves min(delta * decay^d, non-candidate mass) onto the candidates,
    scaling every non-candidate by one factor and every candidate by another."""
    tree = DraftTree.from_parents([0, 1, 2, 3, 0], [-1, 0, 1, 2, 0])
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]])
    case = RelaxCase.of(tree, p)
    engine = step_engine("coolsd", case, {"coolsd": {"delta": 0.4, "decay": 0.5}}, delta=1.0)
    q = relaxed(engine, tree, case.scores)
    candidates = [[1, 0], [2], [3], []]
    for node, (cands, budget) in enumerate(zip(candidates, (0.4, 0.2, 0.1, 0.05))):
        others = [t for t in range(4) if t not in cands]
        moved = min(budget, float(p[node, others].sum())) if cands else 0.0
        assert float(tvd(q[node], p[node])) == pytest.approx(moved, abs=1e-6)
        ratio = q[node] / p[node]
        assert torch.allclose(ratio[others], ratio[others][0].expand(len(others)), atol=1e-6)
        if cands:
            assert torch.allclose(ratio[cands], ratio[cands][0].expand(len(cands)), atol=1e-6)
    assert torch.equal(q[4], p[4])  # a leaf has no candidates


def _engine(problem: statistics.MarkovProblem, options: dict, delta: float | None, tree: TreeConfig = CHAIN) -> Engine:
    return Engine(problem.target, problem.drafter, "coolsd", options, delta=delta, sampling=statistics.SAMPLING, tree=tree,
                  tokenizer=problem.tokenizer, cost_model=statistics.flat_costs())


@pytest.mark.parametrize("acceptance", ["reject", "match"])
def test_zero_relaxation_is_the_ar_law_and_a_relaxed_run_is_not(acceptance: str):
    """delta 0: the joint law of the images' tokens is AR's (the rejection rule's own code
    runs, with no budget); delta 1, decay 1 on the same problem: the test rejects it."""
    problem = statistics.markov_problem(17)
    options = {"coolsd": {"acceptance": acceptance}}
    statistics.check_exact_law(_engine(problem, options, 0.0), seed=100)
    loose = {"coolsd": {"acceptance": acceptance, "delta": 1.0, "decay": 1.0}}
    assert statistics.exact_law_pvalue(_engine(problem, loose, None), seed=100) < statistics.ALPHA


def test_the_rejection_rule_stays_within_delta_end_to_end():
    """Each token's law given the previous token, over 2000 images: within delta (plus the
    sampling tolerance at alpha 1e-4), as the per-position bound promises."""
    problem = statistics.markov_problem(2)
    statistics.check_within_delta(_engine(problem, {"coolsd": {"acceptance": "reject", "delta": 0.3}}, None), seed=20)


def test_the_rejection_rule_refuses_what_it_cannot_verify():
    problem = statistics.markov_problem(0)
    with pytest.raises(SpecimgError, match="chain of sampled drafts"):
        _engine(problem, REJECT, None, tree=statistics.TREE).generate([0], seed=0)
    stacked = Engine(problem.target, problem.drafter, "lantern+coolsd", REJECT, sampling=statistics.SAMPLING, tree=CHAIN,
                     tokenizer=problem.tokenizer, cost_model=statistics.flat_costs())
    with pytest.raises(SpecimgError, match="stacks with no other relaxation"):
        stacked.generate([0] * 20, seed=0)
