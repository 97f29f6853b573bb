"""coolsd (plugins/coolsd.py): E1-E2 at one position checked exactly on random
distributions (the TV the position spends is sum (Q f - P)^+, no residual does better,
Proposition 1 and where it stops holding), E3's schedule written out, E1-E3 spent position
by position on a sampled chain (the acceptance's draws enumerated) and E4 on q_R, the AR law
at zero relaxation (chi-square at ``statistics.ALPHA``, 1e-4 false failures per test) with a
relaxed run failing the same test, the per-token TV bound end to end, and the conformance
kit on its stacks."""

from __future__ import annotations

import math

import pytest
import torch

from specimg import DraftTree, Engine, SpecimgError, TreeConfig
from specimg.relax import tvd
from specimg.testing import statistics
from specimg.testing.conformance import emission, make_conformance_tests, step_engine
from specimg.testing.strategies import RelaxCase
from specimg_plugins.coolsd import relaxation, relaxed_rejection

# the rejection rule on sjd's sampled chains (sjd+coolsd takes acceptance=reject), and the
# default rule after another method's donors
TestCoolSDStacks = make_conformance_tests("sjd+coolsd", "lantern+++coolsd", "coolsd+cascade", examples=10, images=1000, compiles=[])  # coolsd compiles in test_conformance.py
CHAIN = TreeConfig(kind="chain", depth=2, sample=True)
REJECT = {"coolsd": {"acceptance": "reject"}}


def _omega(delta: float, nu: float, position: int, length: int) -> float:
    """E3 written out: delta exp(-nu i - mu), mu = log mean_{j<=L} exp(-nu j)."""
    mu = math.log(sum(math.exp(-nu * j) for j in range(1, length + 1)) / length)
    return delta * math.exp(-nu * position - mu)


def _random_pair(generator: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a draft q over ``vocab`` tokens, with some zeros in each."""
    p, q = (torch.rand(1, vocab, generator=generator, dtype=torch.float64) ** 3 for _ in range(2))
    p[0, 0], q[0, -1] = 0.0, 0.0
    return p / p.sum(), q / q.sum()


def _output_law(p: torch.Tensor, q: torch.Tensor, accept_prob: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """One position's law: accept the draft x ~ q with f(x), else draw the residual."""
    accepted = q * accept_prob
    rejected = 1 - accepted.sum(-1, keepdim=True)
    return accepted + rejected * residual / residual.sum(-1, keepdim=True).clamp(min=1e-300)


def test_e3_the_schedule_decays_exponentially_with_mean_delta():
    positions = torch.tensor([1, 2, 1, 2, 3, 4, 5])
    lengths = torch.tensor([2, 2, 5, 5, 5, 5, 5])
    omega = relaxation(1.1, 0.7, positions, lengths)
    want = [_omega(1.1, 0.7, int(i), int(n)) for i, n in zip(positions, lengths)]
    assert omega.tolist() == pytest.approx(want, rel=1e-12)
    assert float(omega[2:].mean()) == pytest.approx(1.1) and float(omega[3] / omega[2]) == pytest.approx(math.exp(-0.7))
    assert relaxation(2.0, 0.0, positions, lengths).tolist() == [2.0] * 7  # nu 0: uniform relaxation


def test_e2_the_optimal_residual_reaches_the_bound_and_no_other_does_better():
    """On 300 random (p, q, omega): with G*, TV(output, p) is exactly sum (q f - p)^+; for
    omega >= 1 the acceptance rate is exactly 1 - TV(p, q) + that TV (each unit of TVD buys
    one of acceptance) and G* is vanilla's norm((p - q)^+) (Proposition 1); for omega <= 1
    the position is exact.  20 random residuals each never get below G*."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        p, q = _random_pair(generator, 2 + trial % 7)
        omega = torch.rand(1, generator=generator, dtype=torch.float64) * 3
        accept_prob, residual = relaxed_rejection(p, q, omega)
        assert torch.allclose(q * accept_prob, torch.minimum(q, omega * p), atol=1e-15)  # E1
        law = _output_law(p, q, accept_prob, residual)
        spent = tvd(law, p)
        assert torch.allclose(spent, (q * accept_prob - p).clamp(min=0).sum(-1), atol=1e-12)
        if float(omega) >= 1:
            assert torch.allclose((q * accept_prob).sum(-1), 1 - tvd(p, q) + spent, atol=1e-12)
            if residual.sum() > 0:
                vanilla = (p - q).clamp(min=0)
                assert torch.allclose(residual / residual.sum(), vanilla / vanilla.sum(), atol=1e-12)
        else:
            assert float(spent) == pytest.approx(0.0, abs=1e-12)
        others = torch.rand(20, p.shape[-1], generator=generator, dtype=torch.float64)
        assert bool((tvd(_output_law(p, q, accept_prob, others), p) >= spent - 1e-12).all()), f"trial {trial}: a residual beat G*"


def test_e2_wrong_residuals_spend_more():
    """Vanilla's residual where omega < 1 (Proposition 1 used outside its condition), and
    the relaxed target's own residual (norm(max(0, p~ - q)), as LANTERN resamples): each
    spends TVD that G* does not."""
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.2, 0.6]], dtype=torch.float64)
    accept_prob, residual = relaxed_rejection(p, q, torch.tensor([0.5], dtype=torch.float64))
    assert float(tvd(_output_law(p, q, accept_prob, residual), p)) == pytest.approx(0.0, abs=1e-12)
    assert float(tvd(_output_law(p, q, accept_prob, (p - q).clamp(min=0)), p)) > 0.05
    relaxed_target = torch.tensor([[0.3, 0.5, 0.2]], dtype=torch.float64)  # mass moved from token 0 onto token 1
    accept_prob = torch.minimum(relaxed_target / q, torch.ones_like(q))
    optimal = (p - q * accept_prob).clamp(min=0)
    assert float(tvd(_output_law(p, q, accept_prob, optimal), p)) == pytest.approx(0.0)  # q a <= p everywhere: no TVD spent
    assert float(tvd(_output_law(p, q, accept_prob, (relaxed_target - q).clamp(min=0)), p)) == pytest.approx(0.2)


def _sampled_chain(q: torch.Tensor, tokens: list[int]) -> DraftTree:
    """A chain root -> x1 -> x2 whose node i's child was drawn from q[i]."""
    logprobs = [0.0] + [float(q[i, t].log()) for i, t in enumerate(tokens)]
    return DraftTree.from_parents([0, *tokens], [-1, 0, 1], logprobs, draft_probs=q, sampled=True)


def test_e1_to_e3_each_position_emits_its_published_law():
    """The engine's rejection rule on a sampled chain (L = 2), its draws enumerated and
    averaged over each node's draft: the law emitted at position i is E1-E2's with
    omega_i from E3, sum (min(q, omega_i p) - p)^+ from p."""
    generator = torch.Generator().manual_seed(3)
    vocab, delta, nu = 4, 1.5, 0.7
    p = torch.stack([_random_pair(generator, vocab)[0][0] for _ in range(3)]).float()
    q = torch.stack([_random_pair(generator, vocab)[1][0] for _ in range(3)]).float()
    q[2] = 0  # the leaf draws nothing
    options = {"coolsd": {"acceptance": "reject", "omega": delta, "nu": nu}}

    def emitted(first: int, second: int) -> tuple[torch.Tensor, torch.Tensor]:
        case = RelaxCase.of(_sampled_chain(q, [first, second]), p)
        engine = step_engine("coolsd", case, options)
        return emission(lambda g: engine.accept(case.tree, engine.relax(case.tree, case.scores), case.scores, g), case.tree, vocab)

    tokens = range(vocab)
    reached = int(q[0].argmax())  # the root's likeliest draft: accepted with probability > 0
    laws = [
        sum(float(q[0, x]) * emitted(x, reached)[1][0] for x in tokens if q[0, x] > 0),  # after the root, over its draft
        sum(float(q[1, x]) * (lambda r, j: j[1] / r[1])(*emitted(reached, x)) for x in tokens if q[1, x] > 0),  # after node 1, given it is reached
    ]
    for depth, law in enumerate(laws):
        omega = _omega(delta, nu, depth + 1, 2)
        pd, qd = p[depth : depth + 1].double(), q[depth : depth + 1].double()
        want = _output_law(pd, qd, *relaxed_rejection(pd, qd, torch.tensor([omega], dtype=torch.float64)))[0]
        assert torch.allclose(law, want, atol=1e-6), f"position {depth + 1}: {law.tolist()} is not E1-E2's law {want.tolist()}"
        bound = float((torch.minimum(qd, omega * pd) - pd).clamp(min=0).sum())
        assert float(tvd(law, p[depth])) == pytest.approx(bound, abs=1e-6)


def test_e4_scales_the_candidates_by_omega_within_the_budget():
    """q_R at node d scales its candidates' mass by omega_{d+1} (no more than the budget or
    the non-candidates' mass moves; none where omega <= 1), every non-candidate by one factor;
    with one candidate it is E1-E2's law for a point-mass draft."""
    tree = DraftTree.from_parents([0, 1, 2, 3, 0], [-1, 0, 1, 2, 0])  # L = 3
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]])
    case = RelaxCase.of(tree, p)
    for delta, budget in ((2.0, 1.0), (2.0, 0.1)):
        engine = step_engine("coolsd", case, {"coolsd": {"omega": delta, "nu": 0.7, "delta": budget}}, delta=budget)
        q = engine.relax(tree, case.scores)
        for node, cands in enumerate([[1, 0], [2], [3], []]):
            others = [t for t in range(4) if t not in cands]
            omega = _omega(delta, 0.7, node + 1, 3)
            moved = min(budget, max(omega - 1, 0) * float(p[node, cands].sum()), float(p[node, others].sum())) if cands else 0.0
            assert float(tvd(q[node], p[node])) == pytest.approx(moved, abs=1e-6), f"node {node}"
            ratio = q[node] / p[node]
            assert torch.allclose(ratio[others], ratio[others][0].expand(len(others)), atol=1e-6)
            if cands:
                assert torch.allclose(ratio[cands], ratio[cands][0].expand(len(cands)), atol=1e-6)
            if len(cands) == 1 and budget == 1.0:
                point = torch.nn.functional.one_hot(torch.tensor([cands[0]]), 4).double()
                pd = p[node : node + 1].double()
                want = _output_law(pd, point, *relaxed_rejection(pd, point, torch.tensor([omega], dtype=torch.float64)))[0]
                assert torch.allclose(q[node].double(), want, atol=1e-6)
        assert torch.equal(q[4], p[4])  # a leaf has no candidates


def _engine(problem: statistics.MarkovProblem, options: dict, delta: float | None, tree: TreeConfig = CHAIN) -> Engine:
    return Engine(problem.target, problem.drafter, "coolsd", options, delta=delta, sampling=statistics.SAMPLING, tree=tree,
                  tokenizer=problem.tokenizer, cost_model=statistics.flat_costs())


@pytest.mark.parametrize("acceptance", ["reject", "match"])
def test_zero_relaxation_is_the_ar_law_and_a_relaxed_run_is_not(acceptance: str):
    """A zero budget, and (rejection rule) the paper's own zero setting omega = 1 (coolsd.omega 1,
    nu 0: vanilla speculative sampling): the joint law of the images' tokens is AR's; omega
    3, nu 0 on the same problem: the test rejects it."""
    problem = statistics.markov_problem(17)
    statistics.check_exact_law(_engine(problem, {"coolsd": {"acceptance": acceptance}}, 0.0), seed=100)
    if acceptance == "reject":
        statistics.check_exact_law(_engine(problem, {"coolsd": {"acceptance": acceptance, "omega": 1.0, "nu": 0.0}}, None), seed=100)
    loose = {"coolsd": {"acceptance": acceptance, "omega": 3.0, "nu": 0.0, "delta": 1.0}}
    assert statistics.exact_law_pvalue(_engine(problem, loose, None), seed=100) < statistics.ALPHA


def test_the_rejection_rule_stays_within_its_tv_bound_end_to_end():
    """Each token's law given the previous token, over 2000 images, is a mixture of
    per-position laws each within sum (min(q, omega_i p) - p)^+ <= omega_1 - 1 of p (E2; omega
    decreases along the draft): within omega_1 - 1 plus the sampling tolerance at alpha 1e-4
    (Bonferroni over the cells), the stated bound checked empirically."""
    problem = statistics.markov_problem(2)
    engine = _engine(problem, {"coolsd": {"acceptance": "reject", "omega": 1.2, "nu": 0.7}}, None)
    bound = _omega(1.2, 0.7, 1, 2) - 1
    tokens = engine.generate([0] * 2000, seed=20).tokens
    vocab, length = engine.target.vocab_size, tokens.shape[1]
    first, steps = statistics.next_token_laws(engine.target, engine.sampling)
    cells = [(0, torch.ones(len(tokens), dtype=torch.bool), first)]
    cells += [(t, tokens[:, t - 1] == a, steps[t - 1, a]) for t in range(1, length) for a in range(vocab)]
    for t, rows, law in cells:
        count = int(rows.sum())
        if count:
            empirical = torch.bincount(tokens[rows, t], minlength=vocab).double() / count
            assert float(tvd(empirical, law)) <= bound + statistics.tvd_tolerance(count, vocab, statistics.ALPHA / len(cells))


def test_the_rejection_rule_refuses_what_it_cannot_verify():
    problem = statistics.markov_problem(0)
    with pytest.raises(SpecimgError, match="chain of sampled drafts"):
        _engine(problem, REJECT, None, tree=statistics.TREE).generate([0], seed=0)
    stacked = Engine(problem.target, problem.drafter, "lantern+coolsd", REJECT, sampling=statistics.SAMPLING, tree=CHAIN,
                     tokenizer=problem.tokenizer, cost_model=statistics.flat_costs())
    with pytest.raises(SpecimgError, match="stacks with no other relaxation"):
        stacked.generate([0] * 20, seed=0)
