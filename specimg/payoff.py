"""Whether speculation paid in a run, told in the run's own numbers.

The planner chooses trees by the cost model's prediction alone (so that a seed gives the
same images on every run), and the cost model was timed in another minute, perhaps a
busier one.  So a run reports its own clock: what its drafted and its AR steps took, and
their ratio.  "Does not pay" is said only beside a ratio below 1, and where the prediction
and the run's clock disagree the report says that the trees followed the prediction.
"""

from __future__ import annotations

import numpy as np

from specimg.costmodel import CostModel
from specimg.planner import choose
from specimg.stats import RunStats

TUNE_HINT = "`specimg tune --remeasure` measures this machine's costs again"
COSTS_HINT = " (`specimg tune` shows this machine's costs)"
FOLLOWED = "the planner chose by its prediction (the cost model's), never by a run's own times, so that a seed gives the same images"


def _below_one(ratio: float) -> bool:
    """Below 1 as printed (two decimals): 0.997 reads 1.00, which is no loss."""
    return round(ratio, 2) < 1


def measured(run: RunStats) -> str:
    """This run's auto-tree steps as timed: how many drafted, what they gave and took, how
    many ran as AR and what they took, and the drafted steps' speed against AR's."""
    times = run.step_times()
    parts = []
    if times.drafted_ms is not None:
        parts.append(f"{times.drafted_steps} drafted steps, {times.drafted_tokens / times.drafted_steps:.2f} tokens and {times.drafted_ms:.1f} ms each")
    if times.ar_ms is not None:
        parts.append(f"{times.ar_steps} AR steps, {times.ar_ms:.1f} ms each")
    if not parts:
        return "this run: no auto-tree step"
    if times.drafted_steps == 0:
        parts.append("no step drafted")
    elif times.ar_steps == 0:
        parts.append("no AR step to time them against (`--method ar` times one)")
    speed = f": drafted steps at {times.speedup:.2f}x AR's speed" if times.speedup is not None else ""
    return "this run: " + "; ".join(parts) + speed


def predicted(cost: CostModel, run: RunStats) -> float | None:
    """The planner's predicted speedup for the steps that drafted: what its plans expected
    of them.  Each image's prediction also counts its AR steps, each at one AR step for one
    token (``planner.ar_plan``); they are taken out here."""
    times = run.step_times()
    ar = times.ar_steps * cost.ar_ms
    ms = sum(image.predicted_ms for image in run.images) - ar
    if times.drafted_steps == 0 or ms <= 0:
        return None
    return (sum(image.predicted_ar_ms for image in run.images) - ar) / ms


def verdict(cost: CostModel, run: RunStats, method: str = "") -> list[str]:
    """Whether speculation paid, from this run's clock where it timed both kinds of step,
    else from the prediction, said as such; nothing when it paid as predicted.  A line
    that says it does not pay carries no ratio of 1 or more: a prediction that said
    otherwise gets a line of its own."""
    times, share = run.step_times(), run.ar_share
    if not times.drafted_steps and not times.ar_steps:
        return []
    if not times.drafted_steps:
        if method in cost.acceptance:
            best = choose(cost, np.array(cost.acceptance[method]), max(n for n, _ in cost.verify_ms), method=method)
            if _below_one(best.speedup):
                return [
                    f"speculative decoding does not pay on this machine, so every step ran as AR: at the acceptance measured when the cost "
                    f"model was calibrated, the planner predicted its best tree ({best}) at {best.speedup:.2f}x AR's speed{COSTS_HINT}"
                ]
        return [f"every step ran as AR: the planner predicted that no tree would pay{COSTS_HINT}"]
    expected, ratio = predicted(cost, run), times.speedup
    if ratio is None:  # every step drafted: no AR step of this run to measure against
        if expected is not None and _below_one(expected):
            return [f"speculative decoding is predicted not to pay on this machine ({expected:.2f}x AR's speed; this run timed no AR step to check it){COSTS_HINT}"]
        return []
    fell_back = f", so {100 * share:.0f}% of the steps ran as AR" if share else ""
    if _below_one(ratio):
        lines = [f"speculative decoding does not pay on this machine{fell_back}: this run's drafted steps ran at {ratio:.2f}x AR's speed{COSTS_HINT}"]
        if expected is not None and not _below_one(expected):
            lines.append(f"the planner had predicted {expected:.2f}x for those steps: {FOLLOWED}")
        return lines
    if share > 0.5:
        return [
            f"the planner sent {100 * share:.0f}% of the steps to AR, predicting that no tree would pay, but this run's drafted steps ran at "
            f"{ratio:.2f}x AR's speed: {FOLLOWED}; {TUNE_HINT}"
        ]
    if expected is not None and _below_one(expected):
        return [f"this run's drafted steps ran at {ratio:.2f}x AR's speed where the planner predicted {expected:.2f}x: {FOLLOWED}; {TUNE_HINT}"]
    return []
