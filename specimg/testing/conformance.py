"""The conformance kit: the contracts every relaxation method and stack keeps (budget and
exactness, docs/architecture.md), checked through the engine's own relaxation fold and
accept hook.

Each ``check_*`` function raises AssertionError naming the broken property.  For a test
suite, ``make_conformance_tests("mymethod", "cascade+mymethod")`` returns a pytest class
that runs all of them on hypothesis-drawn steps and end to end on Markov toy models::

    from specimg.testing.conformance import make_conformance_tests

    TestMyMethod = make_conformance_tests("mymethod", "cascade+mymethod")
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from specimg import relax
from specimg.cache import CACHE_ENV
from specimg.config import Sampling
from specimg.engine import Engine
from specimg.errors import SpecimgError
from specimg.methods import AR, Member
from specimg.plugins import PluginManager, get_plugin_manager
from specimg.step import Acceptance, Scores
from specimg.testing import statistics
from specimg.testing.exact import outcomes
from specimg.testing.strategies import RelaxCase, budgets, deltas, relax_batches, relax_cases
from specimg.tree import DraftTree

ATOL = 1e-6
"""Slack for float32 rounding in per-token comparisons (mass flow, exact acceptance)."""
TOL = 1e-5
"""Slack on a row's sum and on a total-variation distance."""

Options = Mapping[str, Mapping[str, Any]]


# --- the step the engine runs -------------------------------------------------------------


class _NoDrafter:
    """The kit feeds trees itself; the engine only wants a drafter to exist."""


def step_engine(method: str, case: RelaxCase, options: Options | None = None, delta: float | None = None, plugins: PluginManager | None = None) -> Engine:
    """An engine for ``method`` around the case's target and tokenizer stand-ins; the kit
    uses its stack, its relaxation fold and its accept hook."""
    return Engine(case.target, _NoDrafter(), method, options, case.sampling, delta=delta, tokenizer=case.tokenizer, plugins=plugins)


# --- properties of q_R ----------------------------------------------------------------------


def candidate_mask(tree: DraftTree, vocab: int) -> Tensor:
    """[n, V] true where a token is a child of the node (a candidate)."""
    tokens, _ = tree.candidates()
    index = torch.where(tokens >= 0, tokens, vocab)
    return torch.zeros(tree.size, vocab + 1, dtype=torch.bool).scatter_(1, index, True)[:, :vocab]


def check_distribution(q: Tensor, p: Tensor, name: str = "") -> None:
    """q is a probability distribution per row, zero wherever p is."""
    assert q.shape == p.shape, f"{name}: q_R has shape {tuple(q.shape)}, p {tuple(p.shape)}"
    assert bool(torch.isfinite(q).all()) and bool((q >= 0).all()), f"{name}: q_R has negative or non-finite entries"
    sums = q.double().sum(-1)
    assert bool(((sums - 1).abs() <= TOL).all()), f"{name}: q_R rows sum to {sums.tolist()}"
    leaked = (p == 0) & (q > 0)
    assert not bool(leaked.any()), f"{name}: q_R puts mass on tokens p masks: (node, token) {leaked.nonzero().tolist()}"


def check_within(q: Tensor, p: Tensor, delta: Tensor | float, name: str = "") -> None:
    """TVD(q, p) <= delta at every node."""
    distance = relax.tvd(q, p)
    over = distance > torch.as_tensor(delta, dtype=torch.float64) + TOL
    assert not bool(over.any()), f"{name}: TVD(q_R, p) = {distance.tolist()} exceeds the budget {delta} at nodes {over.nonzero().flatten().tolist()}"


def check_mass_flow(q: Tensor, p: Tensor, tree: DraftTree, name: str = "") -> None:
    """Mass only moves from non-candidates to candidates: q >= p on each node's children's
    tokens and q <= p elsewhere, so the chance of accepting some child never falls."""
    cand = candidate_mask(tree, p.shape[-1])
    lost = cand & (q < p - ATOL)
    gained = ~cand & (q > p + ATOL)
    assert not bool(lost.any()), f"{name}: candidates lost mass: (node, token) {lost.nonzero().tolist()}"
    assert not bool(gained.any()), f"{name}: non-candidates gained mass: (node, token) {gained.nonzero().tolist()}"


def check_relaxation(engine: Engine, case: RelaxCase) -> Tensor:
    """q_R from the engine's fold is a distribution, zero where p is, within the stack's
    delta of p, moves mass only onto candidates, and leaves p untouched; returns q_R."""
    assert engine.stack is not None
    name, p = engine.stack.name, case.p
    before = p.clone()
    q = engine.relax(case.tree, case.scores)
    assert torch.equal(p, before), f"{name}: the relaxation changed the target's distribution in place"
    check_distribution(q, p, name)
    check_within(q, p, engine.stack.delta, name)
    check_mass_flow(q, p, case.tree, name)
    return q


def check_member_budgets(engine: Engine, case: RelaxCase, budget: Tensor) -> None:
    """Each member alone, given per-node ``budget`` [n], spends at most it, and leaves a
    node whose budget is 0 bit-for-bit unchanged; with the stack's delta 0 the engine's
    q_R is p itself."""
    assert engine.stack is not None
    p = case.p
    for name, _, relax_step in engine.relaxers(case.tree, case.scores):
        q = relax_step(dist=p, budget=budget)
        if q is None:
            continue
        check_distribution(q, p, name)
        check_within(q, p, budget, name)
        frozen = budget == 0
        assert torch.equal(q[frozen], p[frozen]), f"{name}: changed nodes {frozen.nonzero().flatten().tolist()} whose budget is 0"
    zero = step_engine(engine.stack.name, case, engine.stack.options_dict(), delta=0.0, plugins=engine.plugins)
    assert zero.relax(case.tree, case.scores) is case.scores.probs, f"{engine.stack.name}: delta 0 did not leave p as it is"


def check_batch(engine: Engine, cases: list[RelaxCase]) -> None:
    """Relaxed as one batch (each member as it declares: once over the forest of every
    image's tree, or tree by tree), every image's q_R is the one it gets alone, up to
    float32 rounding (a forest's matrix products are larger than one tree's)."""
    assert engine.stack is not None
    trees = [case.tree for case in cases]
    scores = Scores(torch.cat([case.p for case in cases]), *(torch.cat(parts, dim=1) for parts in zip(*(case.scores[1:3] for case in cases))))
    forest = DraftTree.forest(trees)
    together = engine.relax(forest, scores)
    for image, (case, (start, stop)) in enumerate(zip(cases, forest.spans)):
        alone = engine.relax(case.tree, case.scores)
        assert torch.allclose(together[start:stop], alone, atol=ATOL, rtol=0), (
            f"{engine.stack.name}: image {image}'s q_R in a batch differs from its own by {(together[start:stop] - alone).abs().max():.3g}"
        )


# --- exact acceptance -----------------------------------------------------------------------


def emission(run: Callable[[torch.Generator], Acceptance], tree: DraftTree, vocab: int) -> tuple[Tensor, Tensor]:
    """The exact law of an accept call, by enumerating its draws: per node u, the
    probability the walk reaches u [n], and the joint probability of reaching u and then
    emitting each token [n, V] (the accepted child's token, or the final next token)."""
    reach = torch.zeros(tree.size, dtype=torch.float64)
    joint = torch.zeros(tree.size, vocab, dtype=torch.float64)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for weight, result in outcomes(lambda: run(torch.Generator().manual_seed(0))):
        path = list(result.path)
        walk = path[0] == 0 and all(parents[child] == node for node, child in zip(path, path[1:]))
        assert walk and 0 <= result.next_token < vocab, f"accept returned an invalid walk {path} -> {result.next_token}"
        emitted = [tokens[child] for child in path[1:]] + [result.next_token]
        for node, token in zip(path, emitted):
            reach[node] += weight
            joint[node, token] += weight
    return reach, joint


def _redraws(tree: DraftTree, node: int) -> Iterator[tuple[float, DraftTree]]:
    """Every draw of ``node``'s children without replacement from its draft distribution,
    in order, with its probability: the randomness recursive rejection averages over."""
    assert tree.draft_probs is not None
    q = tree.draft_probs[node].double()
    children = list(tree.children[node])
    for draw in itertools.permutations(q.nonzero().flatten().tolist(), len(children)):
        weight, left = 1.0, float(q.sum())
        for token in draw:
            weight, left = weight * float(q[token]) / left, left - float(q[token])
        tokens, logprobs = tree.tokens.clone(), tree.logprobs.clone()
        tokens[children] = torch.tensor(draw)
        logprobs[children] = q[list(draw)].log().float()
        yield weight, DraftTree.from_parents(tokens.tolist(), tree.parents.tolist(), logprobs.tolist(), tree.draft_probs, sampled=True)


def check_accept(engine: Engine, case: RelaxCase) -> None:
    """The token emitted after every node the walk can reach follows that node's q_R
    (argmax q_R when greedy), computed exactly by enumerating accept's draws.  For sampled
    trees a node's law is averaged over the draw of its children, as recursive rejection
    is exact only on average over the drafts."""
    assert engine.stack is not None
    tree, vocab = case.tree, case.p.shape[-1]
    internal = [u for u in range(tree.size) if tree.children[u]] if tree.sampled else []
    groups: list[tuple[list[int], Iterator[tuple[float, DraftTree]]]] = [
        ([u for u in range(tree.size) if u not in internal], iter([(1.0, tree)])),
        *(([u], _redraws(tree, u)) for u in internal),
    ]
    for nodes, draws in groups:
        got = torch.zeros(tree.size, vocab, dtype=torch.float64)
        want = torch.zeros_like(got)
        for weight, drawn in draws:
            q = engine.relax(drawn, case.scores)
            reach, joint = emission(lambda g: engine.accept(drawn, q, case.scores, g), drawn, vocab)
            law = torch.nn.functional.one_hot(q.argmax(-1), vocab).double() if case.sampling.greedy else q.double()
            got += weight * joint
            want += weight * reach[:, None] * law
        for u in nodes:
            assert torch.allclose(got[u], want[u], atol=ATOL, rtol=0), (
                f"{engine.stack.name}: accept's output after node {u} is {got[u].tolist()}, but reach x q_R is {want[u].tolist()}"
            )


def check_deterministic(engine: Engine, case: RelaxCase, seed: int) -> None:
    """The same step and seed give the same q_R and the same accepted path."""
    assert engine.stack is not None
    q = engine.relax(case.tree, case.scores)
    assert torch.equal(q, engine.relax(case.tree, case.scores)), f"{engine.stack.name}: q_R differs between calls"
    runs = [engine.accept(case.tree, q, case.scores, torch.Generator().manual_seed(seed))[:2] for _ in range(2)]  # path, next token
    assert runs[0] == runs[1], f"accept gave {runs[0]} and {runs[1]} with the same seed"


def check_compiles(engine: Engine, first: RelaxCase, second: RelaxCase) -> bool:
    """The stack's relaxation as the compiled path runs it (:meth:`Engine.relax`): compiled
    whole (``fullgraph``, the ``aot_eager`` backend) on ``first``, run again without a
    recompile on ``second``, a step of the same shape, and equal to the eager fold's q_R
    on each, bit for bit.  False where the compiler refuses it (a member reads the host),
    as the engine finds out: such a stack folds eagerly on the compiled path."""
    assert engine.stack is not None
    eager = [engine.relax(case.tree, case.scores) for case in (first, second)]
    torch._dynamo.reset()  # one program per example's shape: the kit's examples would pass the compiler's limit
    with mock.patch.dict(os.environ, {"SPECIMG_COMPILE_BACKEND": "aot_eager"}), \
            mock.patch.object(type(engine.target), "step_mode", "compiled", create=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine's word that it folds eagerly: the result says it
        compiled = [engine.relax(first.tree, first.scores)]
        if not engine._fold_compiles:
            return False
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled.append(engine.relax(second.tree, second.scores))
    for step, (want, got) in enumerate(zip(eager, compiled)):
        assert torch.equal(got, want), f"{engine.stack.name}: q_R compiled differs from the eager fold's at step {step}"
    return True


def compile_steps(vocab: int = 6) -> tuple[RelaxCase, RelaxCase]:
    """Two steps of one tree shape (a root with two children, one with a child of its
    own), as a fixed tree's consecutive steps are: fresh tokens and target distributions.
    (One fixed pair per method: a compile costs seconds, too many for drawn examples.)"""
    generator = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 1]
    steps = []
    for _ in range(2):
        tokens = torch.randperm(vocab, generator=generator)[:4].tolist()
        p = torch.softmax(2 * torch.randn(4, vocab, generator=generator, dtype=torch.float64), -1).float()
        steps.append(RelaxCase.of(DraftTree.from_parents(tokens, parents), p))
    return steps[0], steps[1]


def check_conformance(method: str, case: RelaxCase, options: Options | None = None, delta: float | None = None,
                      plugins: PluginManager | None = None, seed: int = 0) -> None:
    """Every step-level check on one case."""
    engine = step_engine(method, case, options, delta, plugins)
    check_relaxation(engine, case)
    check_member_budgets(engine, case, torch.full((case.tree.size,), engine.stack.delta if engine.stack else 0.0, dtype=torch.float64))
    check_accept(engine, case)
    check_deterministic(engine, case, seed)


# --- stacks to cover ------------------------------------------------------------------------

_FIRSTRESULT = ("propose_tree", "score", "accept")


def pair_stacks(plugins: PluginManager | None = None) -> list[str]:
    """Each method that implements a step hook stacked in front of the next one (names in
    order, a cycle), leaving out pairs the engine refuses (both members supply the same
    firstresult hook)."""
    plugins = plugins or get_plugin_manager()
    members = {name: Member(spec, spec.defaults) for name, spec in sorted(plugins.methods().items())}
    names = [name for name, m in members.items() if any(plugins.implementers(h, [m]) for h in (*_FIRSTRESULT, "build_relaxed_dist"))]
    pairs = [(a, b) for a, b in zip(names, names[1:] + names[:1]) if a != b]
    return [f"{a}+{b}" for a, b in pairs if all(len(plugins.implementers(h, [members[a], members[b]])) < 2 for h in _FIRSTRESULT)]


# --- the pytest factory ---------------------------------------------------------------------


def _budget_options(data: st.DataObject, method: str, options: Options | None, plugins: PluginManager) -> tuple[dict[str, dict[str, Any]], float | None]:
    """The user's options with each member's delta (unless the user set it) and the stack's
    delta drawn, so budgets of every size, shared or not, are exercised."""
    chosen = {name: dict(values) for name, values in (options or {}).items()}
    for member in plugins.stack(method, options).members:
        name = member.spec.name
        if "delta" in attrs.fields_dict(member.spec.options) and "delta" not in chosen.get(name, {}):
            chosen.setdefault(name, {})["delta"] = data.draw(deltas(), label=f"{name}.delta")
    return chosen, data.draw(st.none() | deltas(), label="stack delta")


def make_conformance_tests(
    *methods: str,
    options: Options | None = None,
    plugins: PluginManager | None = None,
    examples: int = 20,
    images: int = statistics.IMAGES,
    compiles: Sequence[str] | None = None,
) -> type:
    """A pytest test class checking each of ``methods`` (names or stacks such as
    ``"cascade+mymethod"``) against the contract; assign it to a ``Test*`` name in a test
    module.  ``options`` are per-method option values (as the engine takes them), held
    fixed while budgets are drawn; ``examples`` is hypothesis's count per step-level test,
    ``images`` the sample size of the end-to-end tests; ``compiles``, the methods whose
    relaxation ``test_compiles`` compiles (default: all; a compile costs seconds)."""
    manager = plugins or get_plugin_manager()
    run = settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    over_methods = pytest.mark.parametrize("method", methods)

    def require_budget(method: str) -> None:
        """A stack running a rule with no TVD budget (a paper mode) is held to its own
        published law by its own tests; the budget checks do not apply to it."""
        unbudgeted = manager.stack(method, options).unbudgeted
        if unbudgeted:
            pytest.skip(f"{method}: {', '.join(unbudgeted)} runs a rule with no TVD budget (a paper mode); its own tests hold it to its published law")

    def engine_for(method: str, case: RelaxCase, data: st.DataObject, budgeted: bool = True) -> Engine:
        """The step engine with drawn budgets; ``budgeted``: skip a stack with no TVD budget."""
        if budgeted:
            require_budget(method)
        chosen, delta = _budget_options(data, method, options, manager)
        return step_engine(method, case, chosen, delta, manager)

    def markov_engine(method: str, problem: statistics.MarkovProblem, delta: float | None, **kwargs: Any) -> Engine:
        if method == AR:
            return Engine(problem.target, method=AR, **kwargs)
        return Engine(problem.target, problem.drafter, method, options, delta=delta, tokenizer=problem.tokenizer, plugins=manager, **kwargs)

    def batch_engine(method: str, problem: statistics.MarkovProblem, delta: float | None, batch: int, **kwargs: Any) -> Engine:
        """``markov_engine`` at batch size ``batch``; skips a method that batches cannot run (it scores trees itself)."""
        try:
            return markov_engine(method, problem, delta, batch_size=batch, **kwargs)
        except SpecimgError as error:
            if batch == 1:
                raise
            pytest.skip(f"{method} runs at batch size 1 only: {error}")

    class TestConformance:
        @pytest.fixture(autouse=True, scope="class")
        @classmethod
        def _isolated(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
            """Tiny tensors run fastest on one thread; caches go to a temporary folder."""
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("specimg-cache")))
                yield
            torch.set_num_threads(threads)

        @over_methods
        @run
        @given(case=relax_cases(), data=st.data())
        def test_relaxation(self, method: str, case: RelaxCase, data: st.DataObject) -> None:
            check_relaxation(engine_for(method, case, data), case)

        @over_methods
        @run
        @given(case=relax_cases(), data=st.data())
        def test_member_budgets(self, method: str, case: RelaxCase, data: st.DataObject) -> None:
            check_member_budgets(engine_for(method, case, data), case, data.draw(budgets(case.tree.size), label="budget"))

        @over_methods
        @run
        @given(cases=relax_batches(), data=st.data())
        def test_batch_relaxation(self, method: str, cases: list[RelaxCase], data: st.DataObject) -> None:
            check_batch(engine_for(method, cases[0], data), cases)

        @pytest.mark.parametrize("method", methods if compiles is None else compiles)
        def test_compiles(self, method: str) -> None:
            first, second = compile_steps()
            engine = step_engine(method, first, options, None, manager)
            assert engine.hooks is not None and engine.stack is not None
            if not engine.hooks.relaxers or engine.stack.delta == 0 or not engine.stack.members[0].budgeted:
                pytest.skip(f"{method}: relaxes nothing under a budget by default")
            if not check_compiles(engine, first, second):
                pytest.skip(f"{method}: the compiler refuses its relaxation (it reads the host); it folds eagerly on the compiled path")

        @over_methods
        @run
        @given(case=relax_cases(vocab=st.integers(2, 4), max_nodes=5), data=st.data())
        def test_accept_exact(self, method: str, case: RelaxCase, data: st.DataObject) -> None:
            check_accept(engine_for(method, case, data), case)

        @over_methods
        @run
        @given(case=relax_cases(vocab=st.integers(2, 4), max_nodes=4, max_children=2, sampled=True), data=st.data())
        def test_accept_exact_sampled_tree(self, method: str, case: RelaxCase, data: st.DataObject) -> None:
            check_accept(engine_for(method, case, data), case)

        @over_methods
        @run
        @given(seed=st.integers(0, 2**32 - 1), data=st.data())
        def test_deterministic(self, method: str, seed: int, data: st.DataObject) -> None:
            """A drafter-free stack is fed the trees it makes itself: sampled chains."""
            chains = manager.stack(method, options).drafter_free is not None
            case = data.draw(relax_cases(max_children=1, sampled=True) if chains else relax_cases(), label="case")
            check_deterministic(engine_for(method, case, data, budgeted=False), case, seed)

        @over_methods
        @pytest.mark.parametrize(("sample", "batch"), [(False, 1), (True, 1), (True, 3)], ids=["topk-tree", "sampled-tree", "sampled-tree-B3"])
        def test_exact_law_at_delta_0(self, method: str, sample: bool, batch: int) -> None:
            """delta = 0: the images' token sequences follow the AR law (chi-square), also
            decoded three at a time (each image its own trees and accepted lengths)."""
            problem = statistics.markov_problem(seed=1)
            engine = batch_engine(method, problem, 0.0, batch, sampling=statistics.SAMPLING, tree=attrs.evolve(statistics.TREE, sample=sample))
            statistics.check_exact_law(engine, images, seed=10)

        @over_methods
        def test_a_batch_makes_the_images_of_one_at_a_time(self, method: str) -> None:
            """At batch size 3 the hooks run image by image: each image is the one its seed
            gives alone (the Markov toy rounds alike in a batch)."""
            problem = statistics.markov_problem(seed=4)
            engines = [batch_engine(method, problem, None, b, sampling=statistics.SAMPLING, tree=attrs.evolve(statistics.TREE, sample=True)) for b in (1, 3)]
            one, three = (engine.generate([0] * 7, seed=5) for engine in engines)
            assert torch.equal(three.tokens, one.tokens), f"{method}: batch size 3 changed the images"
            assert [s.accepted for s in three.stats.images] == [s.accepted for s in one.stats.images]

        @over_methods
        def test_next_token_within_delta(self, method: str) -> None:
            """delta > 0: each next-token law given the previous token stays within delta."""
            require_budget(method)
            problem = statistics.markov_problem(seed=2)
            engine = markov_engine(method, problem, 0.3, sampling=statistics.SAMPLING, tree=statistics.TREE)
            statistics.check_within_delta(engine, images, seed=20)

        @over_methods
        def test_greedy_is_ar_at_delta_0(self, method: str) -> None:
            """Temperature 0, delta 0: the same tokens as AR greedy decoding."""
            for seed in range(10):
                problem = statistics.markov_problem(seed=seed)
                greedy = Sampling(temperature=0.0, cfg_scale=2.0)
                tokens = [markov_engine(m, problem, 0.0, sampling=greedy).generate([0, 1], seed=seed).tokens for m in (method, AR)]
                assert torch.equal(*tokens), f"{method}: greedy tokens {tokens[0].tolist()} differ from AR's {tokens[1].tolist()}"

        @over_methods
        def test_same_seed_same_images(self, method: str) -> None:
            problem = statistics.markov_problem(seed=3)
            engine = markov_engine(method, problem, None, sampling=statistics.SAMPLING, tree=attrs.evolve(statistics.TREE, sample=True))
            assert torch.equal(engine.generate([0] * 20, seed=5).tokens, engine.generate([0] * 20, seed=5).tokens)

    return TestConformance
