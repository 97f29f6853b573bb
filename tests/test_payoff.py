"""A run's report of whether speculation paid: its own step times, by hand; "does not pay"
only beside ratios below 1; the prediction named where it and the run's clock disagree;
and the engine's timing of drafted and AR steps."""

import re

import attrs
import numpy as np
import pytest

import specimg
from specimg import costs, payoff
from specimg.costmodel import CostModel
from specimg.models.eagle import build_drafter
from specimg.models.llamagen import build_target
from specimg.planner import choose
from specimg.stats import ImageStats, RunStats

TINY = dict(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=64, num_classes=5, block_size=16)
RATES = np.array([[0.6 * 0.45**r for r in range(10)]] * 10)


def machine(verify: dict[int, float], ar: float = 1.0, acceptance: dict | None = None) -> CostModel:
    flat = ((1, 0.0), (10, 0.0))
    return CostModel("test", "made up", tuple(sorted(verify.items())), flat, flat, 0.0, 0.0, ar, acceptance=acceptance or {})


def image(drafted: int, accepted: int, drafted_s: float, ar: int, ar_s: float, plan_ms: float = 1.5, plan_tokens: float = 2.0) -> ImageStats:
    """Statistics of an image that drafted ``drafted`` steps (depth 1, top-k 1, 2 nodes), each
    accepting ``accepted`` tokens, then ran ``ar`` AR steps, the cost model's AR step 1 ms."""
    trees = [[0, 1, 1, 2]] * bool(drafted) + [[drafted, 0, 0, 1]] * bool(ar)
    return ImageStats(
        tokens=drafted * (accepted + 1) + ar + 1, target_forwards=drafted + ar + 1, tree_sizes=[2] * drafted + [1] * ar,
        accepted=[accepted] * drafted + [0] * ar, trees=trees, predicted_ms=drafted * plan_ms + ar * 1.0,
        predicted_ar_ms=drafted * plan_tokens + ar * 1.0, drafted_seconds=drafted_s, ar_seconds=ar_s,
    )


def unpaid_ratios_below_one(lines: list[str]) -> bool:
    """The rule: a line that says speculation does not pay carries no ratio of 1 or more."""
    return all(float(x) < 1 for line in lines if "does not pay" in line for x in re.findall(r"(\d+\.\d+)x", line))


def test_the_run_s_own_step_times_by_hand():
    run = RunStats((image(10, 1, 0.030, 30, 0.060),))  # 2 tokens in 3 ms a drafted step, 2 ms an AR step
    times = run.step_times()
    assert (times.drafted_steps, times.drafted_tokens, times.ar_steps) == (10, 20, 30)
    assert times.drafted_ms == pytest.approx(3.0) and times.ar_ms == pytest.approx(2.0)
    assert times.speedup == pytest.approx(2 * 2.0 / 3.0)
    assert payoff.measured(run) == "this run: 10 drafted steps, 2.00 tokens and 3.0 ms each; 30 AR steps, 2.0 ms each: drafted steps at 1.33x AR's speed"
    assert payoff.predicted(machine({1: 1.0, 8: 2.0}), run) == pytest.approx(2.0 / 1.5)  # the plans' 2 tokens in 1.5 ms, the AR steps taken out


def test_mostly_ar_yet_faster_drafts_say_the_prediction_chose_and_never_does_not_pay():
    """The first run's contradiction: most steps sent to AR while its drafted steps beat AR."""
    run = RunStats((image(10, 1, 0.030, 30, 0.060),))
    lines = payoff.verdict(machine({1: 1.0, 8: 2.0}), run)
    assert len(lines) == 1 and "does not pay" not in lines[0]
    assert "sent 75% of the steps to AR" in lines[0] and "ran at 1.33x AR's speed" in lines[0] and payoff.FOLLOWED in lines[0]


def test_slower_drafts_do_not_pay_and_a_prediction_above_one_gets_its_own_line():
    run = RunStats((image(10, 1, 0.050, 30, 0.060),))  # 2 tokens in 5 ms against 2 ms a token: 0.80x
    lines = payoff.verdict(machine({1: 1.0, 8: 2.0}), run)
    assert lines[0].startswith("speculative decoding does not pay on this machine, so 75% of the steps ran as AR: this run's drafted steps ran at 0.80x")
    assert lines[1] == f"the planner had predicted 1.33x for those steps: {payoff.FOLLOWED}"
    assert unpaid_ratios_below_one(lines)


def test_every_step_ar_gives_the_calibrated_prediction_and_this_run_s_ar_time():
    hopeless = machine({1: 1.0, 2: 5.0, 128: 500.0}, acceptance={"naive": tuple(map(tuple, RATES))})
    run = RunStats((image(0, 0, 0.0, 40, 0.080),))
    best = choose(hopeless, RATES, 128, method="naive")
    assert best.speedup < 1
    assert payoff.measured(run) == "this run: 40 AR steps, 2.0 ms each; no step drafted"
    [line] = payoff.verdict(hopeless, run, "naive")
    assert f"so every step ran as AR: at the acceptance measured when the cost model was calibrated, the planner predicted its best tree ({best}) at {best.speedup:.2f}x" in line


def test_without_ar_steps_a_prediction_below_one_is_said_as_a_prediction():
    run = RunStats((image(10, 1, 0.050, 0, 0.0, plan_ms=4.0),))  # predicted: 2 tokens in 4 ms, 0.50x
    assert payoff.measured(run).endswith("no AR step to time them against (`--method ar` times one)")
    [line] = payoff.verdict(machine({1: 1.0, 8: 2.0}), run)
    assert "does not pay" not in line and "predicted not to pay on this machine (0.50x AR's speed; this run timed no AR step to check it)" in line
    assert payoff.verdict(machine({1: 1.0, 8: 2.0}), RunStats((image(10, 1, 0.050, 0, 0.0),))) == []  # predicted 1.33x: nothing to add


def test_a_run_that_paid_as_predicted_says_nothing_more():
    assert payoff.verdict(machine({1: 1.0, 8: 2.0}), RunStats((image(30, 1, 0.090, 10, 0.020),))) == []


def test_no_line_that_says_does_not_pay_carries_a_ratio_above_one():
    """Random runs (seeded; the check is exact, so it cannot fail by chance)."""
    rng = np.random.default_rng(0)
    cost = machine({1: 1.0, 2: 5.0, 128: 500.0}, acceptance={"naive": tuple(map(tuple, RATES))})
    said = 0
    for _ in range(500):
        drafted, ar = int(rng.integers(0, 50)), int(rng.integers(0, 50))
        run = RunStats((image(drafted, int(rng.integers(0, 4)), drafted * rng.uniform(1, 8) / 1000, ar, ar * rng.uniform(1, 4) / 1000,
                              plan_ms=rng.uniform(0.5, 6.0), plan_tokens=rng.uniform(1.0, 4.0)),))
        lines = payoff.verdict(cost, run, "naive")
        said += any("does not pay" in line for line in lines)
        assert unpaid_ratios_below_one(lines), lines
    assert said > 50  # the rule was exercised
    assert not unpaid_ratios_below_one(["speculative decoding does not pay on this machine: 534 drafted steps (1.11x)"])  # the first run's line fails it


@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_engine_times_an_image_s_drafted_and_ar_steps(batch_size):
    target = build_target("GPT-B", seed=0, **{**TINY, "block_size": 64})
    drafter = build_drafter(target, seed=1)  # random: its drafts are almost never accepted, so the planner sends it to AR
    dear = machine({1: 1.0, 2: 1.2, 128: 100.0})
    engine = specimg.Engine(target, drafter, "naive", sampling=specimg.Sampling(temperature=0.0, cfg_scale=2.0), cost_model=dear, batch_size=batch_size)
    out = engine.generate([1, 2], seed=3)
    times = out.stats.step_times()
    assert times.drafted_steps > 0 and times.ar_steps > 0  # it drafted, then went AR
    for image_stats in out.stats.images:
        assert image_stats.drafted_seconds > 0 and image_stats.ar_seconds > 0
        assert image_stats.drafted_seconds + image_stats.ar_seconds <= image_stats.wall
    assert ImageStats.from_dict(out.stats.images[0].as_dict()).ar_seconds == pytest.approx(out.stats.images[0].ar_seconds, abs=1e-5)
    hopeless = attrs.evolve(dear, acceptance={costs.scale_key(engine.stack): tuple(map(tuple, np.full((10, 10), 0.01)))})
    engine.cost_model = hopeless
    sent = engine.generate([1, 2], seed=3).stats
    assert sent.step_times().drafted_steps == 0
    assert all(s.drafted_seconds < s.ar_seconds for s in sent.images)
