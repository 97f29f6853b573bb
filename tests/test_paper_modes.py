"""mode=paper: gsd's group acceptance with the released code's groups, held exactly (every
draft and every draw enumerated, so no false failures) against a separate transcription
of the published rule, and a wrong grouping (specimg's symmetric window) failing it."""

from __future__ import annotations

import pytest
import torch

from specimg import DraftTree, Engine, MethodSpec, SpecimgError, hookimpl
from specimg.accept import reject_forest
from specimg.methods import make_options
from specimg.step import Acceptance, Scores, Step
from specimg.plugins import PluginManager
from specimg.testing import statistics
from specimg.testing.conformance import emission
from specimg_plugins import gsd, sjd

P = torch.tensor([0.02, 0.20, 0.05, 0.18, 0.25, 0.10, 0.12, 0.08])
Q = torch.tensor([0.10, 0.05, 0.20, 0.15, 0.10, 0.15, 0.05, 0.20])
EMBEDDINGS = torch.tensor([[0.0, 0.0], [0.1, 0.2], [0.6, 0.0], [0.2, 0.1], [0.3, 0.3], [0.0, 0.9], [0.4, 0.2], [0.1, 0.1]])
PAPER = gsd.GSDOptions(mode="paper", w=2)


def published_group(x: int, p: list[float], emb: list[list[float]], w: int, p_thr: float, l2_thr: float,
                    clamp_bottom: bool = False) -> list[int]:
    """GSD's group of x as the paper and the released code define it: x and the tokens at
    positions [r - w, r + w) of the ascending order of p (r: x's position), with a
    probability gap below p_thr and squared L2 embedding distance below l2_thr.  The
    release takes them as ``ascending[r - w : r + w]``: the top end is cut off, and for
    r < w the negative start empties the slice, so x stands alone (its except branch:
    the plain p(x) / q(x)).  ``clamp_bottom``: the wrong reading, a window cut at 0."""
    ascending = sorted(range(len(p)), key=lambda t: (p[t], t))
    r = ascending.index(x)
    if r - w < 0 and not clamp_bottom:
        return [x]
    window = [ascending[i] for i in range(max(0, r - w), min(len(p), r + w)) if i != r]
    near = [t for t in window if abs(p[t] - p[x]) < p_thr and sum((a - b) ** 2 for a, b in zip(emb[t], emb[x])) < l2_thr]
    return [x] + near


def published_law(x: int, w: int, clamp_bottom: bool = False) -> torch.Tensor:
    """The token emitted after draft x ~ q: x with min(1, p(G)/q(G)), else norm(max(0, p - q))."""
    group = published_group(x, P.tolist(), EMBEDDINGS.tolist(), w, 0.15, 0.5, clamp_bottom)
    ratio = min(1.0, float(P[group].sum() / Q[group].sum()))
    residual = (P - Q).clamp(min=0).double()
    law = (1 - ratio) * residual / residual.sum()
    law[x] += ratio
    return law


def plugin_law(x: int, options: gsd.GSDOptions) -> torch.Tensor:
    tree = DraftTree.from_parents([0, x], [-1, 0], draft_probs=torch.stack([Q, torch.zeros_like(Q)]), sampled=True)
    _, joint = emission(lambda g: gsd.group_acceptance(tree, torch.stack([P, P]), EMBEDDINGS, g, options), tree, P.shape[0])
    return joint[0]


@pytest.mark.parametrize("x", range(P.shape[0]))
def test_paper_gsd_follows_the_published_law(x: int):
    assert torch.allclose(plugin_law(x, PAPER), published_law(x, PAPER.w), atol=1e-12)


def test_the_example_has_groups():
    sizes = [len(published_group(x, P.tolist(), EMBEDDINGS.tolist(), 2, 0.15, 0.5)) for x in range(P.shape[0])]
    assert max(sizes) >= 3


def test_the_least_likely_drafts_have_no_group():
    """The two least likely tokens (ranks 0 and 1 < w) stand alone, as the release's empty
    slice leaves them; a window cut at rank 0 would give them donors here, and fails."""
    ascending = sorted(range(P.shape[0]), key=lambda t: (float(P[t]), t))
    for x in ascending[: PAPER.w]:
        assert published_group(x, P.tolist(), EMBEDDINGS.tolist(), PAPER.w, 0.15, 0.5) == [x]
        assert len(published_group(x, P.tolist(), EMBEDDINGS.tolist(), PAPER.w, 0.15, 0.5, clamp_bottom=True)) > 1
        assert torch.allclose(plugin_law(x, PAPER), published_law(x, PAPER.w), atol=1e-12)
        assert not torch.allclose(plugin_law(x, PAPER), published_law(x, PAPER.w, clamp_bottom=True), atol=1e-6)


def test_a_symmetric_window_fails_the_published_law():
    """Power: specimg's own grouping (+-w ranks, cosine) is not the released rule here."""
    wrong = gsd.GSDOptions(acceptance="group", w=2)
    assert any(not torch.allclose(plugin_law(x, wrong), published_law(x, 2), atol=1e-6) for x in range(P.shape[0]))


def test_paper_mode_declares_no_budget_and_is_gsd_beside_sjd():
    plugins = PluginManager()
    assert not plugins.stack("sjd+gsd", {"gsd": {"mode": "paper"}}).budgeted
    assert plugins.stack("sjd+gsd", {"gsd": {"mode": "specimg"}}).budgeted
    assert plugins.stack("gsd").budgeted  # alone, on a drafter's trees, the budgeted rule
    assert plugins.stack("sjd+gsd").options_dict()["gsd"]["mode"] == "paper"  # beside sjd, GSD as published
    assert plugins.stack("sjd+gsd").options_dict()["sjd"] == {"window": 16, "mode": "paper", "init": "random", "ar_tail": 10}  # on SJD's Lumina-mGPT release
    assert plugins.stack("sjd").options_dict()["sjd"]["mode"] == "specimg"


def test_an_unknown_mode_is_refused():
    with pytest.raises((SpecimgError, ValueError)):
        gsd.GSDOptions(mode="published")


# --- sjd mode=paper: one-hot q for fresh tokens, the window counts the committed token ---

SJD_PROBLEM = 10


def _paper_sjd(window: int, ar_tail: int = 0, **kwargs) -> Engine:
    problem = statistics.markov_problem(SJD_PROBLEM, **kwargs)
    return Engine(problem.target, None, "sjd", {"sjd": {"window": window, "mode": "paper", "ar_tail": ar_tail}}, statistics.SAMPLING,
                  tokenizer=problem.tokenizer)


def test_paper_sjd_follows_the_ar_law():
    """A uniform draw x accepted with p(x), else y ~ norm(max(0, p - onehot(x))), emits y
    with probability p(y): the released rule is exact (chi-square at statistics.ALPHA)."""
    statistics.check_exact_law(_paper_sjd(window=3), seed=100)


def test_paper_sjd_fresh_rows_are_one_hot_and_the_window_counts_the_committed_token():
    engine = _paper_sjd(window=4, num_tokens=12)
    assert max(engine.generate([0] * 4, seed=0).stats.images[0].tree_sizes) == 4  # root + 3 drafts
    options = sjd.SJDOptions(window=16, mode="paper")
    assert options.drafts == 15 and sjd.SJDOptions().drafts == 16


def test_paper_sjd_decodes_the_images_tail_as_released():
    """The release's jacobi_loop_interval: no draft in the last ar_tail positions (LlamaGen's
    18 as published, 10 beside gsd), so the last steps are AR, one token each; still exact."""
    spec = PluginManager().methods()["sjd"]
    assert make_options(spec, spec.paper or {}).ar_tail == 18 and sjd.SJDOptions().ar_tail == 0
    engine = _paper_sjd(window=4, ar_tail=5, num_tokens=12)
    for seed in range(5):
        sizes = engine.generate([0], seed=seed).stats.images[0].tree_sizes
        assert sizes[-4:] == [1, 1, 1, 1] and max(sizes) == 4
    statistics.check_exact_law(_paper_sjd(window=3, ar_tail=1), seed=101)


def published_fresh_acceptance(p: torch.Tensor, x: int) -> float:
    """The released code's test for a freshly drawn token: q(x) = 1, so min(1, p(x) / 1)."""
    return min(1.0, float(p[x]))


def _fresh_window(one_hot_fresh: bool, seed: int) -> DraftTree:
    """sjd's window after a prefill step (nothing to carry): one fresh draft."""
    empty = torch.zeros(1, 1, 2)
    previous = Step(DraftTree.from_parents([0], [-1]), Scores(P[None], empty, torch.zeros(1, 1, 8)), Acceptance([0], 3))
    return sjd.jacobi_window(previous, 3, 1, torch.Generator().manual_seed(seed), greedy=False, one_hot_fresh=one_hot_fresh)


@pytest.mark.parametrize("seed", range(4))
def test_a_fresh_token_is_accepted_with_p(seed: int):
    """sjd's paper window through the core's recursive rejection, enumerated exactly: the
    fresh x is accepted with p(x) and a rejection follows norm(max(0, p - onehot(x))).
    specimg's uniform q accepts min(1, V p(x)) instead (the power check)."""
    for one_hot_fresh in (True, False):
        tree = _fresh_window(one_hot_fresh, seed)
        x = int(tree.tokens[1])
        _, joint = emission(lambda g: reject_forest(tree, [0], torch.stack([P, P]), [g])[0], tree, 8)
        residual = (P - torch.nn.functional.one_hot(torch.tensor(x), 8)).clamp(min=0).double()
        want = (1 - published_fresh_acceptance(P, x)) * residual / residual.sum()
        want[x] += published_fresh_acceptance(P, x)
        assert torch.allclose(joint[0], want, atol=1e-12) == one_hot_fresh, (x, one_hot_fresh)


# --- sjd's repeat_horizon: new positions copy the last token before them -----------------


def released_repeat(known: list[int], new: int) -> list[int]:
    """The released prior (scheduler/jacobi_iteration_lumina_mgpt.py:539-594 of
    tyshiwo1/Accelerating-T2I-AR-with-SJD) for ``new`` positions after the ``known`` tokens
    (the image so far, then the carried drafts): position j takes the token at j - 1,
    clamped to the last known index, as its index arithmetic does (the end-of-line slot it
    skips on Lumina-mGPT has no counterpart here)."""
    start = len(known)
    return [known[min(j - 1, start - 1)] for j in range(start, start + new)]


@pytest.mark.parametrize(("image", "drafts", "carried"), [
    ([5, 6, 7, 8, 9], [1, 2, 3, 4], 1), ([5, 6], [1, 2, 3], 0), ([4], [1, 2], 2), ([3, 3, 9], [1, 2, 3, 4, 5], 3),
])
def test_repeat_horizon_copies_the_last_token_as_released(image: list[int], drafts: list[int], carried: int):
    got, repeated = sjd.repeat_horizon(torch.tensor(drafts), carried=carried, root_token=image[-1])
    assert got.tolist() == drafts[:carried] + released_repeat(image + drafts[:carried], len(drafts) - carried)
    assert repeated.tolist() == [False] * carried + [True] * (len(drafts) - carried)


def test_the_row_above_is_not_the_released_prior():
    """Power: the old reading (the token a grid row above) differs from the release's here."""
    image, width = [5, 6, 7, 8, 9], 3
    row_above = [([*image, 1][len(image) + i - width]) for i in range(1, 4)]  # drafts at image indices 6, 7, 8
    got, _ = sjd.repeat_horizon(torch.tensor([1, 2, 3, 4]), carried=1, root_token=image[-1])
    assert got.tolist()[1:] == released_repeat([*image, 1], 3) != row_above


def test_sjd_as_published_draws_new_positions_at_random():
    """The release's LlamaGen script names repeat_horizon but reads the grid width from its
    first logits processor, a top-k warper without one, so the prior is never applied."""
    spec = PluginManager().methods()["sjd"]
    published = make_options(spec, spec.paper or {})
    assert (published.mode, published.init, published.window) == ("paper", "random", 16)


def _sjd_on_a_grid(init: str, mode: str = "specimg", plugins: PluginManager | None = None, method: str = "sjd") -> Engine:
    problem = statistics.markov_problem(10, num_tokens=4)  # a 2 x 2 grid: the second row repeats the first
    options = {method: {"window": 3, "init": init, "mode": mode}}
    return Engine(problem.target, None, method, options, statistics.SAMPLING, tokenizer=problem.tokenizer, plugins=plugins)


@pytest.mark.parametrize("mode", ["specimg", "paper"])
def test_repeat_horizon_keeps_the_ar_law(mode: str):
    statistics.check_exact_law(_sjd_on_a_grid("repeat_horizon", mode), seed=7)


class UniformQForRepeats:
    """repeat_horizon's drafts, but the repeated tokens keep the uniform q they were not drawn from."""

    @hookimpl
    def register_methods(self, register):
        register(MethodSpec("wrong-horizon", sjd.SJDOptions, "a wrong q", drafter=False))

    @hookimpl
    def propose_tree(self, root_token, max_depth, previous, generator, options):
        length = min(options.window, max_depth)
        tree = sjd.jacobi_window(previous, root_token, length, generator, greedy=False)
        drafts, _ = sjd.repeat_horizon(tree.tokens[1:], sjd.window_drafts(previous, length)[1], root_token)
        return DraftTree.from_tensors(torch.cat([tree.tokens[:1], drafts]), tree.parents, tree.depths, tree.logprobs,
                                      tree.draft_probs, sampled=True, width=1, height=length)


def test_repeats_with_the_q_they_were_not_drawn_from_fail_the_law():
    plugins = PluginManager(autoload=False)
    plugins.register(UniformQForRepeats(), name="wrong-horizon")
    engine = _sjd_on_a_grid("random", plugins=plugins, method="wrong-horizon")
    assert statistics.exact_law_pvalue(engine, seed=7) < statistics.ALPHA


def test_repeat_horizon_needs_no_grid():
    problem = statistics.markov_problem(10, num_tokens=3)
    engine = Engine(problem.target, None, "sjd", {"sjd": {"init": "repeat_horizon"}}, statistics.SAMPLING, tokenizer=problem.tokenizer)
    assert engine.generate([0], seed=0).tokens.shape == (1, 3)
