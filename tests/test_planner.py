"""Auto trees: the planner's arithmetic by hand, its choice on made-up machines, the profile
it learns, the cost model's cache, and the engine's use of them."""

import json
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

import specimg
from specimg import costs, planner
from specimg.compiled import CompileClock
from specimg.costmodel import CostModel
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.planner import AcceptanceProfile, choose, expected_tokens
from specimg.tree import DraftTree

TINY = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=64, num_classes=5, block_size=16)


def machine(verify: dict[int, float], level: float = 0.0, start: float = 0.0, ar: float = 1.0) -> CostModel:
    widths = ((1, level), (10, level))
    return CostModel("test", "made up", tuple(sorted(verify.items())), ((1, 0.0), (10, 0.0)), widths, start, 0.0, ar)


def test_the_planner_imports_the_pure_cost_model_and_nothing_that_measures_or_decodes():
    """The planner reads tables: its imports (apart from the package's ``__init__``, which
    imports the engine) reach no models, tree builders, step programs or measuring."""
    code = (
        "import pathlib, sys, types; package = types.ModuleType('specimg'); package.__path__ = [str(pathlib.Path('specimg').resolve())]; "
        "sys.modules['specimg'] = package; import specimg.planner; print(' '.join(sorted(m for m in sys.modules if m.startswith('specimg'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], cwd=Path(specimg.__file__).parent.parent, capture_output=True, text=True, check=True).stdout.split()
    assert set(loaded) == {"specimg", "specimg.config", "specimg.costmodel", "specimg.errors", "specimg.planner", "specimg.profile"}


def test_expected_tokens_follow_the_eagle2_tree_by_hand():
    rates = np.array([[0.7, 0.28] + [0.0] * 8] * 10)
    # level 1: 0.7, 0.28; level 2 (both expanded): 0.49, 0.196, 0.196, 0.0784; best first, summed
    np.testing.assert_allclose(expected_tokens(rates, 2, 2), [1, 1.7, 2.19, 2.47, 2.666, 2.862, 2.9404])
    # top-k 1 is a chain: 1 + 0.7 + 0.49 + 0.343
    np.testing.assert_allclose(expected_tokens(rates, 3, 1), [1, 1.7, 2.19, 2.533])


def test_a_flat_machine_gets_the_deepest_tree_that_fits_and_a_steep_one_a_small_tree():
    chain_only = np.array([[0.9] + [0.0] * 9] * 10)
    flat_to_8 = machine({1: 1.0, 8: 1.0, 9: 50.0, 128: 1000.0})
    plan = choose(flat_to_8, chain_only, max_nodes=128)
    assert (plan.depth, plan.topk, plan.nodes) == (7, 1, 8)  # ties go to the narrower tree
    assert plan.tokens_per_step == pytest.approx(1 + sum(0.9**d for d in range(1, 8)))
    assert plan.speedup == pytest.approx(plan.tokens_per_step)  # one AR step's time per step
    steep = machine({1: 1.0, 2: 1.6, 3: 2.6, 128: 200.0})
    assert choose(steep, chain_only, max_nodes=128).nodes == 2  # 1.9 tokens in 1.6 beats 2.71 in 2.6


def test_wide_rates_make_wide_trees_and_limits_hold():
    wide = np.array([[0.3] * 10] * 10)
    plan = choose(machine({1: 1.0, 16: 1.0, 17: 100.0}), wide, max_nodes=128)
    assert plan.topk > 1 and plan.nodes == 16
    assert choose(machine({1: 1.0, 128: 1.0}), wide, max_nodes=6).nodes <= 6
    capped = choose(machine({1: 1.0, 128: 1.0}), wide, max_nodes=128, max_fed=4)
    assert (capped.depth - 1) * capped.topk <= 4


def test_the_profile_learns_what_each_child_was_worth():
    tree = DraftTree.from_parents([5, 1, 2, 3], [-1, 0, 0, 1])  # root: children 1 (rank 0), 2 (rank 1); node 1: child 3
    dist = torch.zeros(4, 6)
    dist[0, [1, 2, 4]] = torch.tensor([0.5, 0.2, 0.3])
    dist[1, [3, 0]] = torch.tensor([0.6, 0.4])
    profile = AcceptanceProfile(depth=3, width=2)
    before = profile.sums.clone(), profile.counts.clone()
    profile.observe(tree, dist, [0, 1], greedy=False)
    added = profile.sums - before[0], profile.counts - before[1]
    torch.testing.assert_close(added[0], torch.tensor([[0.5, 0.2], [0.6, 0.0], [0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(added[1], torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64))
    profile.observe(tree, dist, [0, 1], greedy=True)  # argmax: token 1 at the root (rank 0), token 3 at node 1
    assert profile.sums[0, 0] - before[0][0, 0] == pytest.approx(1.5)
    rates = profile.rates()
    assert np.all(np.diff(rates, axis=1) <= 0)


def test_the_engine_plans_on_its_cost_model_and_stays_deterministic():
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    flat = machine({1: 1.0, 6: 1.0, 7: 100.0, 128: 100.0})
    engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=2.0), cost_model=flat)
    out = engine.generate([1, 2], seed=3)
    for image in out.stats.images:
        assert image.trees and all(nodes <= 6 for _, _, _, nodes in image.trees)
        assert max(image.tree_sizes) <= 6 and image.predicted_speedup is not None
    again = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=2.0), cost_model=flat).generate([2], seed=4)
    assert torch.equal(again.tokens[0], out.tokens[1])  # per-image planning: no dependence on earlier images


def test_cost_model_is_measured_once_and_read_back_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_memory", {})
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    sampling = specimg.Sampling(cfg_scale=2.0)
    model = costs.load_or_measure(target, drafter, sampling, 0)
    verify = dict(model.verify_ms)
    assert set(verify) >= {1, 8, 128} and all(ms > 0 for ms in verify.values())
    assert list(verify.values()) == sorted(verify.values())
    files = list((tmp_path / "costs").glob("*.json"))
    assert [f.stem for f in files] == [model.key]
    monkeypatch.setattr(costs, "_memory", {})
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert costs.load_or_measure(target, drafter, sampling, 0) == model
    other = costs.cost_key(target, drafter, specimg.Sampling(cfg_scale=1.0))[0]
    assert other != model.key  # no CFG: one row, other timings


def test_planner_replans_from_the_profile():
    rates_machine = machine({1: 1.0, 4: 1.2, 16: 2.0, 128: 20.0})
    p = planner.TreePlanner(rates_machine, max_nodes=128, max_fed=128, device="cpu")
    first = p.plan
    tree = DraftTree.from_parents([0, 1, 2, 3, 4], [-1, 0, 1, 2, 3])
    dist = torch.zeros(5, 8)
    dist[torch.arange(5), torch.tensor([1, 2, 3, 4, 0])] = 1.0  # each node's child is certain
    for _ in range(planner.REPLAN_EVERY * 4):
        p.observe(tree, dist, [0, 1, 2, 3, 4], greedy=False)
    assert p.plan.depth > first.depth and p.plan.topk == 1  # every first draft accepted: deep chains pay
    assert [start for start, _ in p.plans] == sorted({start for start, _ in p.plans})


def test_tune_ranks_candidate_trees_and_names_the_auto_choice(tmp_path, capsys):
    from specimg.cli import main

    main(["tune", "--model", "tiny-random", "-n", "1", "--out", str(tmp_path)])

    result = json.loads((tmp_path / "tune.json").read_text())
    speedups = [c["speedup"] for c in result["candidates"]]
    assert speedups == sorted(speedups, reverse=True)
    assert result["choice"] == result["candidates"][0]
    assert {(c["depth"], c["topk"]) for c in result["candidates"]} >= {(1, 1), (2, 2), (10, 1)}
    assert "auto would choose" in capsys.readouterr().out
    assert (tmp_path / "tune.png").stat().st_size > 0


@pytest.mark.parametrize("batch", ["1", "2"])
def test_tune_reports_the_trees_generate_picks_on_the_same_images(tmp_path, monkeypatch, capsys, batch: str):
    """Also at a batch size: both plan with the cost model measured at that size."""
    from specimg.cli import main
    from specimg.stats import ImageStats, RunStats

    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path / "cache"))  # one cost model for both commands
    main(["tune", "--model", "tiny-random", "-n", "2", "--seed", "3", "--batch-size", batch, "--out", str(tmp_path / "tune")])
    assert ("2 images decoded together" in capsys.readouterr().out) == (batch == "2")
    main(["generate", "--model", "tiny-random", "-n", "2", "--seed", "3", "--batch-size", batch, "--out", str(tmp_path / "gen")])

    told = json.loads((tmp_path / "tune" / "tune.json").read_text())["generate_trees"]
    lines = [json.loads(line) for line in (tmp_path / "gen" / "manifest.jsonl").read_text().splitlines()]
    ran = RunStats(tuple(ImageStats.from_dict(entry["stats"]) for entry in lines if "stats" in entry))
    assert told == [{"depth": d, "topk": k, "nodes": n, "steps": steps, "tokens": tokens} for (d, k, n), (steps, tokens) in ran.tree_use().items()]


def test_run_stats_count_steps_and_tokens_per_auto_tree():
    from specimg.stats import ImageStats, RunStats

    image = ImageStats(accepted=[1, 0, 0, 0, 2], tree_sizes=[2, 2, 1, 1, 4], trees=[[0, 1, 1, 2], [2, 0, 0, 1], [4, 1, 3, 4]])
    run = RunStats((image,))
    assert run.tree_use() == {(0, 0, 1): (2, 2), (1, 1, 2): (2, 3), (1, 3, 4): (1, 3)}
    assert run.ar_share == pytest.approx(2 / 5)
    assert run.tree_shares(top=2) == "depth 1, top-k 1, 2 nodes (40% of steps), AR (no tree predicted to pay) (40% of steps)"  # ties: first used first


def test_each_method_stack_gets_its_step_scale_and_acceptance_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_memory", {})
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    sampling = specimg.Sampling(cfg_scale=2.0)
    naive_engine = specimg.Engine(target, drafter, "naive", sampling=sampling)
    naive = costs.scale_key(naive_engine.stack)
    model = naive_engine.prepare(0)
    assert set(model.step_scales) == {naive} and model.step_scales[naive] > 0
    assert set(model.acceptance) == {naive} and model.calibrated(naive)
    rates = np.array(model.acceptance[naive])
    assert rates.shape == (10, 10) and np.all((rates >= 0) & (rates <= 1)) and np.all(np.diff(rates, axis=1) <= 0)
    monkeypatch.setattr(costs, "_memory", {})  # read back from the cache file, scale included, then one more stack
    cascade_engine = specimg.Engine(target, drafter, "cascade", sampling=sampling)
    both = cascade_engine.prepare(0)
    assert both.step_scales[naive] == model.step_scales[naive] and set(both.step_scales) == {naive, costs.scale_key(cascade_engine.stack)}
    assert both.acceptance[naive] == model.acceptance[naive] and both.calibrated(costs.scale_key(cascade_engine.stack))
    fixed = specimg.Engine(target, drafter, "gsd", sampling=sampling, tree=specimg.TreeConfig(depth=2))
    assert fixed.prepare(0) is None and costs.load_or_measure(target, drafter, sampling, 0) == both  # a fixed tree is never planned: nothing to scale
    plan_naive = choose(both, TYPICAL_RATES, 128, method=naive)
    assert plan_naive.step_ms == pytest.approx(float(both.step(plan_naive.depth, plan_naive.topk, plan_naive.nodes, naive)))


def test_a_step_scale_is_the_stacks_real_to_timed_ratio_over_ars():
    # the stack's steps took twice what the parts say, AR's 1.25 times: 1.6
    assert costs.step_scale(2.0, 1000.0, 1.25, 1000.0) == pytest.approx(1.6)
    # parts timed on a machine 3 times slower scale both predictions alike: the same scale
    assert costs.step_scale(2.0, 3000.0, 1.25, 3000.0) == pytest.approx(1.6)


def test_a_calibration_does_not_carry_the_speed_of_the_minute_the_parts_were_timed(tmp_path, monkeypatch):
    """Parts timed 20 times slower than the machine runs now (a busy minute, another load)
    would give a scale of a twentieth if the stack's steps were divided by them alone; the
    AR images decoded beside the stack's carry the same factor, so the scale stays put."""
    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path))
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    sampling = specimg.Sampling(cfg_scale=2.0)
    parts = costs.measure(target, drafter, sampling, 0, *costs.cost_key(target, drafter, sampling))

    scales = {}
    for factor in (1.0, 20.0):
        monkeypatch.setattr(costs, "_memory", {})
        monkeypatch.setattr(costs, "measure", lambda *args, factor=factor, **kwargs: parts.slower(factor))
        costs.forget(target, drafter, sampling)
        engine = specimg.Engine(target, drafter, "naive", sampling=sampling)
        scales[factor] = engine.prepare(0).scale(costs.scale_key(engine.stack))
    assert scales[20.0] > scales[1.0] / 4  # timing noise moves it, the parts' speed does not (else about 1/20)


def test_a_calibration_leaves_out_what_its_decodes_spend_compiling():
    """A compile is one-off work (seconds, where it happens on a shape's first use), no
    step's cost: a decode's wall time is counted without it."""
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    engine = specimg.Engine(target, drafter, "naive")

    def decode() -> float:
        CompileClock.seconds += 2.5
        return 3.0

    assert engine._steady(decode) == pytest.approx(0.5)


TYPICAL_RATES = np.array([[0.6 * 0.45**r for r in range(10)]] * 10)


def test_when_no_tree_pays_the_image_finishes_with_ar_steps():
    """The prior (first child accepted half the time) makes a 2-node tree pay on this
    machine; steps in which nothing is accepted make none pay, and the planner turns to AR."""
    dear = machine({1: 1.0, 2: 1.2, 128: 100.0})
    tree = DraftTree.from_parents([0, 1], [-1, 0])
    dist = torch.zeros(2, 4)
    dist[:, 3] = 1.0  # the drafted child never has a chance
    for fallback in (True, False):
        p = planner.TreePlanner(dear, max_nodes=128, max_fed=128, device="cpu", ar_fallback=fallback)
        assert not p.plan.is_ar and p.plan.speedup > 1
        for _ in range(planner.REPLAN_EVERY):
            p.observe(tree, dist, [0], greedy=False)
        assert p.plan.is_ar == fallback
        assert p.plan.speedup == 1.0 if fallback else p.plan.speedup < 1.0
    assert str(planner.ar_plan(dear)) == "AR (no tree predicted to pay)"
    hopeless = machine({1: 1.0, 2: 5.0, 128: 500.0})
    assert not planner.TreePlanner(hopeless, max_nodes=128, max_fed=128, device="cpu").plan.is_ar  # the weak prior is no evidence


def test_a_measured_acceptance_is_the_first_plan_s_evidence():
    """With the stack's acceptance from its calibration, the first plan is the tree those
    chances favour, or AR from the first step where none pays (unless AR fallback is off)."""
    by_depth = TYPICAL_RATES * np.linspace(1.0, 0.5, 10)[:, None]  # deeper drafts fare worse
    np.testing.assert_array_equal(AcceptanceProfile(prior=by_depth).rates(), by_depth)  # kept as measured, depth by depth
    measured = {"naive": tuple(map(tuple, TYPICAL_RATES))}
    cheap = attrs.evolve(machine({1: 1.0, 8: 1.2, 128: 100.0}), acceptance=measured)
    first = planner.TreePlanner(cheap, max_nodes=128, max_fed=128, device="cpu", method="naive").plan
    assert first == choose(cheap, TYPICAL_RATES, 128, method="naive") and first.speedup > 1
    hopeless = attrs.evolve(machine({1: 1.0, 2: 5.0, 128: 500.0}), acceptance=measured)
    assert planner.TreePlanner(hopeless, max_nodes=128, max_fed=128, device="cpu", method="naive").plan.is_ar
    assert not planner.TreePlanner(hopeless, max_nodes=128, max_fed=128, device="cpu", method="naive", ar_fallback=False).plan.is_ar
    assert not planner.TreePlanner(hopeless, max_nodes=128, max_fed=128, device="cpu", method="cascade").plan.is_ar  # another stack's: no evidence


@pytest.mark.parametrize(("batch_size", "mode"), [(1, "eager"), (2, "eager"), (2, "static")])
def test_an_image_the_measured_acceptance_sends_to_ar_never_drafts_and_equals_ar(batch_size, mode):
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    target.set_step_mode(mode)  # static: the fixed-shape steps the compiled path runs
    greedy = specimg.Sampling(temperature=0.0, cfg_scale=2.0)
    engine = specimg.Engine(target, drafter, "naive", sampling=greedy, batch_size=batch_size)
    hopeless = attrs.evolve(machine({1: 1.0, 2: 5.0, 128: 500.0}), acceptance={costs.scale_key(engine.stack): tuple(map(tuple, TYPICAL_RATES))})
    engine.cost_model = hopeless
    drafted, trees_verified = [], []
    engine.on_step = lambda *step: drafted.append(step)
    verify_trees = target.forward_trees
    target.forward_trees = lambda *args: trees_verified.append(args) or verify_trees(*args)
    out = engine.generate([1, 3, 0, 2], seed=3)
    assert not drafted and not trees_verified  # a batch at one length takes batched AR steps
    for image in out.stats.images:
        assert image.trees == [[0, 0, 0, 1]] and image.target_forwards == target.num_tokens
        assert image.tree_sizes == [1] * (target.num_tokens - 1) and image.predicted_speedup == pytest.approx(1.0)
    ar = specimg.Engine(target, None, "ar", sampling=greedy).generate([1, 3, 0, 2], seed=3)
    assert torch.equal(out.tokens, ar.tokens)


def test_the_engine_finishes_ar_where_no_tree_pays_and_greedy_still_equals_ar():
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64})
    drafter = build_drafter(target, seed=1)  # random: its drafts are almost never accepted
    dear = machine({1: 1.0, 2: 1.2, 128: 100.0})
    greedy = specimg.Sampling(temperature=0.0, cfg_scale=2.0)
    out = specimg.Engine(target, drafter, "naive", sampling=greedy, cost_model=dear).generate([1], seed=3)
    image = out.stats.images[0]
    assert image.trees[0][3] > 1 and image.trees[-1] == [planner.REPLAN_EVERY, 0, 0, 1]
    steps = len(image.accepted)
    assert image.target_forwards == 1 + steps and image.tree_sizes[planner.REPLAN_EVERY :] == [1] * (steps - planner.REPLAN_EVERY)
    assert out.stats.trees()["AR (no tree predicted to pay)"] == steps - planner.REPLAN_EVERY
    ar = specimg.Engine(target, None, "ar", sampling=greedy).generate([1], seed=3)
    assert torch.equal(out.tokens, ar.tokens)
    kept = specimg.Engine(target, drafter, "naive", sampling=greedy, cost_model=dear, tree=specimg.TreeConfig(ar_fallback=False))
    assert all(nodes > 1 for *_, nodes in kept.generate([1], seed=3).stats.images[0].trees)


def test_an_engine_s_first_use_says_on_stderr_that_it_measures_and_a_cached_one_does_not(tmp_path, monkeypatch, capsys):
    from specimg.engine import MEASURING

    monkeypatch.setenv("SPECIMG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_memory", {})
    target = build_target("GPT-B", seed=0, **TINY)
    drafter = build_drafter(target, seed=1)
    for _ in range(2):
        specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(cfg_scale=2.0)).generate([1], seed=0)
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.strip()]  # in a log: its final count (a bar on a terminal)
    assert line.startswith(f"{MEASURING}: 100% {2 * target.num_tokens}/{2 * target.num_tokens}")  # the second engine is silent
