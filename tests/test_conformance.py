"""The conformance kit on every installed method and a cycle of two-method stacks, and
proofs that its checks catch what they claim to catch."""

from __future__ import annotations

import attrs
import pytest
import torch

from specimg import MethodSpec, TreeConfig, hookimpl
from specimg.accept import walk_forest
from specimg.engine import Engine
from specimg.plugins import PluginManager, get_plugin_manager
from specimg import relax
from specimg.relax import transfer
from specimg.step import Acceptance
from specimg.testing import statistics
from specimg.testing.conformance import (
    check_accept,
    check_relaxation,
    check_compiles,
    emission,
    make_conformance_tests,
    pair_stacks,
    step_engine,
)
from specimg.testing.exact import NotEnumerable, outcomes
from specimg.testing.markov import MarkovDrafter, MarkovTarget
from specimg.testing.strategies import RelaxCase
from specimg.tree import DraftTree

PLUGINS = get_plugin_manager()
TestConformance = make_conformance_tests(*sorted(PLUGINS.methods()), *pair_stacks(PLUGINS), compiles=sorted(PLUGINS.methods()))  # stacks compile in tests/test_compile.py
# the papers' choices within the budget (docs/methods.md): LANTERN's raw codebook and budget
# per candidate, LANTERN++'s cap-only rule (delta 1) on the raw codebook; mode=paper, which
# keeps no budget, is held to its published law in tests/test_lantern_paper.py
TestLanternPaperChoices = make_conformance_tests("lantern", "cascade+lantern", options={"lantern": {"codebook": "raw", "budget": "candidate"}}, compiles=["lantern"])
# cascade's own extension: donors from outside the tree, nearest by input embedding
TestCascadeBeyondTree = make_conformance_tests("cascade", "cascade+lantern", options={"cascade": {"beyond_tree": 3}}, compiles=["cascade"])
TestLanternPPPaperChoices = make_conformance_tests("lantern++", "cascade+lantern++", options={"lantern++": {"codebook": "raw", "delta": 1.0}}, compiles=["lantern++"])


def _manager(*plugins: object) -> PluginManager:
    manager = PluginManager(autoload=False)
    for plugin in plugins:
        manager.register(plugin, name=type(plugin).__name__)
    return manager


def test_pair_stacks_cover_every_method_with_a_step_hook():
    stacks = pair_stacks(PLUGINS)
    covered = {n for n in PLUGINS.methods() if any(s.startswith(f"{n}+") or s.endswith(f"+{n}") for s in stacks)}
    assert {"cascade", "gsd", "lantern"} <= covered
    assert "naive" not in covered  # it only registers a name: stacking it adds nothing


# --- the enumeration is exact ----------------------------------------------------------------


def test_emission_of_sample_and_match_is_reach_times_q():
    tree = DraftTree.from_parents([0, 1, 2, 0], [-1, 0, 0, 1])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.2, 0.2, 0.6], [0.0, 0.5, 0.5]])
    reach, joint = emission(lambda g: walk_forest(tree, [0], q, [g])[0], tree, 3)
    want_reach = torch.tensor([1.0, 0.3, 0.2, 0.3 * 0.6], dtype=torch.float64)
    assert torch.allclose(reach, want_reach)
    assert torch.allclose(joint, want_reach[:, None] * q.double())


def test_outcomes_refuses_what_it_cannot_enumerate():
    with pytest.raises(NotEnumerable, match="randn"):
        outcomes(lambda: torch.randn(2))

    def compare_twice() -> tuple[bool, bool]:
        u = torch.rand(())
        return bool(u < 0.3), bool(u < 0.5)

    with pytest.raises(NotEnumerable, match="more than once"):
        outcomes(compare_twice)
    with pytest.raises(NotEnumerable, match="broadcast"):
        outcomes(lambda: torch.rand(()) * torch.tensor([0.5, 2.0]) <= 0.3)
    assert sorted(outcomes(lambda: bool(0.5 >= torch.rand(()) * 2))) == [(0.25, True), (0.75, False)]


# --- the checks have teeth ---------------------------------------------------------------------


class RedrawOnReject:
    """Sample-and-match, except that a rejected node emits a fresh draw from q_R instead of
    the draw that was rejected: children come out too often."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("redraw"))

    @hookimpl
    def accept(self, tree, dist, generator):
        draws = torch.multinomial(dist, 1, generator=generator).squeeze(1).tolist()
        path, node = [0], 0
        while True:
            child = next((c for c in tree.children[node] if int(tree.tokens[c]) == draws[node]), None)
            if child is None:
                return Acceptance(path, int(torch.multinomial(dist[node], 1, generator=generator)))
            path.append(child)
            node = child


@attrs.frozen
class Budget:
    delta: float = 0.3


class Shuffle:
    """Moves mass between two non-candidates: within budget, so the core's fold lets it
    through, but not the relaxation the contract allows."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("shuffle", Budget))

    @hookimpl
    def build_relaxed_dist(self, dist, budget):
        out = dist.clone()
        moved = torch.minimum(out[:, 1], budget.float())
        out[:, 1] -= moved
        out[:, 2] += moved
        return out


class Lazy:
    """A relaxation that passes (returns None) unless a node's first child is token 1: legal
    under the hook contract, and its q_R is within budget of p whatever it does."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("lazy", Budget))

    @hookimpl
    def build_relaxed_dist(self, dist, target_dist, budget, tree):
        candidates, _ = tree.candidates()
        if not bool((candidates[:, 0] == 1).any()):
            return None
        donors = torch.arange(dist.shape[-1]).expand(*candidates.shape, -1)
        return transfer(dist, target_dist, candidates, donors, budget)[0]


class Peeking:
    """It asks the host whether any node has candidates: the compiler refuses that read (a
    CUDA graph would keep its first answer for good)."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("peeking", Budget))

    @hookimpl
    def build_relaxed_dist(self, dist, target_dist, budget, tree):
        candidates, _ = tree.candidates()
        if not bool((candidates >= 0).any()):
            return None
        return transfer(dist, target_dist, candidates, torch.arange(dist.shape[-1]).expand(*candidates.shape, -1), budget)[0]


def _two_steps() -> tuple[RelaxCase, RelaxCase]:
    """One tree shape, two steps: the root's two children relabelled, p alike."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]])
    return (RelaxCase.of(DraftTree.from_parents([0, 1, 2], [-1, 0, 0]), p),
            RelaxCase.of(DraftTree.from_parents([0, 3, 0], [-1, 0, 0]), p))


def test_the_compiler_proves_a_relaxation_capturable_and_refuses_a_host_read():
    first, second = _two_steps()
    assert check_compiles(step_engine("lantern", first), first, second)
    peeking = step_engine("peeking", first, plugins=_manager(Peeking()))
    assert not check_compiles(peeking, first, second)
    assert not peeking._fold_compiles  # the engine folds it eagerly from then on
    assert torch.equal(peeking.relax(second.tree, second.scores), relax_eagerly(peeking, second))


def relax_eagerly(engine, case):
    """The eager fold of ``engine``'s stack on one case."""
    return relax.fold(case.scores.probs, engine.relaxers(case.tree, case.scores), engine.stack.delta)


def test_check_accept_catches_a_wrong_acceptance_rule():
    tree = DraftTree.from_parents([0, 0], [-1, 0])
    case = RelaxCase.of(tree, torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]))
    check_accept(step_engine("naive", case), case)
    with pytest.raises(AssertionError, match="accept's output after node 0"):
        check_accept(step_engine("redraw", case, plugins=_manager(RedrawOnReject())), case)


def test_recursive_rejection_survives_a_draft_equal_to_p_up_to_rounding():
    """q(x) one float32 step above p(x) and q >= p elsewhere: rejecting x has probability
    ~1e-7, and then max(p - q, 0) has no mass left; it used to be normalised to NaN."""
    p = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    draft = torch.stack([torch.stack([torch.nextafter(p[0, 0], torch.tensor(1.0)), p[0, 1]]), torch.zeros(2)])
    tree = DraftTree.from_parents([0, 0], [-1, 0], [0.0, float(draft[0, 0].log())], draft_probs=draft, sampled=True)
    case = RelaxCase.of(tree, p)
    check_accept(step_engine("naive", case), case)


def test_check_relaxation_catches_mass_moved_between_non_candidates():
    tree = DraftTree.from_parents([0, 0], [-1, 0])
    case = RelaxCase.of(tree, torch.tensor([[0.4, 0.3, 0.3], [0.2, 0.3, 0.5]]))
    with pytest.raises(AssertionError, match="non-candidates gained mass"):
        check_relaxation(step_engine("shuffle", case, plugins=_manager(Shuffle())), case)


def test_kit_a_relaxation_that_sometimes_passes_keeps_accept_exact_on_sampled_trees():
    """Recursive rejection is exact only averaged over all drafts: chosen per draft (where
    the relaxation happened to pass), it would emit token 0 with probability 0.75."""
    draft = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    tree = DraftTree.from_parents([0, 0], [-1, 0], [0.0, -0.69], draft_probs=draft, sampled=True)
    case = RelaxCase.of(tree, torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    engine = step_engine("lazy", case, {"lazy": {"delta": 0.01}}, plugins=_manager(Lazy()))
    assert engine.relax(tree, case.scores) is case.p  # passes on this draft
    check_accept(engine, case)


def test_engine_a_relaxation_that_sometimes_passes_stays_within_delta_on_sampled_trees():
    """p uniform over 2 tokens, one child drawn from a uniform drafter: recursive rejection
    on just the drafts where the relaxation passes would emit token 0 with probability
    0.75, not 0.5 +- delta (the engine once chose the rule per draft)."""
    flat = torch.zeros(2, 2)
    target = MarkovTarget(flat, flat[0], num_tokens=3)
    engine = Engine(
        target, MarkovDrafter(flat), "lazy", {"lazy": {"delta": 0.01}}, tree=TreeConfig(kind="chain", depth=1, sample=True),
        plugins=_manager(Lazy()),
    )
    statistics.check_within_delta(engine, seed=0)
