"""Decode statistics, collected by the engine itself."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import attrs

from specimg.planner import tree_name

PHASES = ("draft", "verify", "relax", "accept", "commit")


@attrs.define
class ImageStats:
    """One image: target forwards (the prefill counts), per step the tree size and the
    number of drafted tokens accepted, seconds per phase, and wall time.  With auto trees
    also the trees chosen ([step, depth, top-k, nodes] from that step on) and the cost
    model's prediction for the steps taken: their milliseconds, and what AR would have
    taken for the tokens they were expected to give.  ``tvd``: the budget actually spent,
    the mean TVD(q_R, p) at the nodes whose draws the speculative steps emitted (their
    walked paths).  ``drafted_seconds`` and ``ar_seconds``: with auto trees, the wall time
    of the steps that drafted and of those the planner sent to AR (in a batch, the image's
    share), so that a run says what its own steps took."""

    tokens: int = 0
    target_forwards: int = 0
    tree_sizes: list[int] = attrs.field(factory=list)
    accepted: list[int] = attrs.field(factory=list)
    seconds: dict[str, float] = attrs.field(factory=lambda: defaultdict(float))
    wall: float = 0.0
    trees: list[list[int]] = attrs.field(factory=list)
    predicted_ms: float = 0.0
    predicted_ar_ms: float = 0.0
    tvd: float | None = 0.0
    drafted_seconds: float = 0.0
    ar_seconds: float = 0.0

    @property
    def predicted_speedup(self) -> float | None:
        return self.predicted_ar_ms / self.predicted_ms if self.predicted_ms else None

    @property
    def tau(self) -> float:
        """Tokens per target forward (AR = 1.00)."""
        return self.tokens / max(1, self.target_forwards)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "tau": round(self.tau, 4),
            "wall_s": round(self.wall, 4),
            "seconds": {k: round(v, 5) for k, v in self.seconds.items()},
            "tree_sizes": self.tree_sizes,
            "accepted": self.accepted,
            **({"tvd": round(self.tvd, 6)} if self.tvd is not None else {}),
            **({"trees": self.trees, "predicted_ms": round(self.predicted_ms, 4), "predicted_ar_ms": round(self.predicted_ar_ms, 4),
                "drafted_s": round(self.drafted_seconds, 5), "ar_s": round(self.ar_seconds, 5)} if self.trees else {}),
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> ImageStats:
        """The statistics ``as_dict`` wrote (times as rounded there): runs read back from a manifest."""
        return cls(
            tokens=record["tokens"], target_forwards=record["target_forwards"],
            tree_sizes=list(record["tree_sizes"]), accepted=list(record["accepted"]),
            seconds=defaultdict(float, record["seconds"]), wall=record["wall_s"],
            trees=[list(tree) for tree in record.get("trees", [])],
            predicted_ms=record.get("predicted_ms", 0.0), predicted_ar_ms=record.get("predicted_ar_ms", 0.0),
            tvd=record.get("tvd"), drafted_seconds=record.get("drafted_s", 0.0), ar_seconds=record.get("ar_s", 0.0),
        )


@attrs.frozen
class RunStats:
    images: tuple[ImageStats, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.images)

    @property
    def target_forwards(self) -> int:
        return sum(s.target_forwards for s in self.images)

    @property
    def tau(self) -> float:
        return self.tokens / max(1, self.target_forwards)

    @property
    def wall(self) -> float:
        return sum(s.wall for s in self.images)

    @property
    def mean_accepted(self) -> float:
        steps = [a for s in self.images for a in s.accepted]
        return sum(steps) / max(1, len(steps))

    @property
    def tvd(self) -> float | None:
        """The budget spent per emitted token, pooled over the images (None when a record
        predates the measure)."""
        if any(s.tvd is None for s in self.images):
            return None
        emitted = [sum(s.accepted) + len(s.accepted) for s in self.images]
        return sum(s.tvd * e for s, e in zip(self.images, emitted)) / max(1, sum(emitted))

    @property
    def mean_tree_size(self) -> float:
        sizes = [n for s in self.images for n in s.tree_sizes]
        return sum(sizes) / max(1, len(sizes))

    @property
    def predicted_speedup(self) -> float | None:
        """The cost model's speedup over AR for the trees chosen (auto trees only)."""
        ms = sum(s.predicted_ms for s in self.images)
        return sum(s.predicted_ar_ms for s in self.images) / ms if ms else None

    def tree_use(self) -> dict[tuple[int, int, int], tuple[int, int]]:
        """Per auto tree (depth, top-k, nodes): the steps it ran and the tokens they gave,
        most used first."""
        use: dict[tuple[int, int, int], list[int]] = defaultdict(lambda: [0, 0])
        for s in self.images:
            bounds = [start for start, *_ in s.trees] + [len(s.accepted)]
            for (start, depth, topk, nodes), end in zip(s.trees, bounds[1:]):
                use[depth, topk, nodes][0] += end - start
                use[depth, topk, nodes][1] += sum(s.accepted[start:end]) + end - start
        return {tree: (steps, tokens) for tree, (steps, tokens) in sorted(use.items(), key=lambda kv: -kv[1][0])}

    def tree_steps(self) -> dict[tuple[int, int, int], int]:
        """How many steps each auto tree (depth, top-k, nodes) ran, most used first."""
        return {tree: steps for tree, (steps, _) in self.tree_use().items()}

    def trees(self) -> dict[str, int]:
        """``tree_steps`` in words ("depth D, top-k K, N nodes")."""
        return {tree_name(d, k, n): steps for (d, k, n), steps in self.tree_steps().items()}

    def tree_shares(self, top: int = 3) -> str:
        """The ``top`` most used auto trees with their share of the steps."""
        steps = self.trees()
        total = sum(steps.values()) or 1
        return ", ".join(f"{tree} ({100 * n / total:.0f}% of steps)" for tree, n in list(steps.items())[:top])

    @property
    def ar_share(self) -> float:
        """The share of auto-tree steps that ran as AR (the planner's one-node tree)."""
        steps = self.tree_steps()
        return sum(n for (_, _, nodes), n in steps.items() if nodes == 1) / max(1, sum(steps.values()))

    def step_times(self) -> StepTimes:
        """This run's auto-tree steps as its own clock timed them."""
        drafted = {tree: use for tree, use in self.tree_use().items() if tree[2] > 1}
        return StepTimes(
            drafted_steps=sum(steps for steps, _ in drafted.values()), drafted_tokens=sum(tokens for _, tokens in drafted.values()),
            drafted_seconds=sum(s.drafted_seconds for s in self.images),
            ar_steps=sum(steps for (_, _, nodes), steps in self.tree_steps().items() if nodes == 1), ar_seconds=sum(s.ar_seconds for s in self.images),
        )

    def seconds(self) -> dict[str, float]:
        total: dict[str, float] = defaultdict(float)
        for s in self.images:
            for phase, sec in s.seconds.items():
                total[phase] += sec
        return dict(total)


@attrs.frozen
class StepTimes:
    """A run's auto-tree steps as its own clock timed them: those that drafted (how many,
    the tokens they gave, their seconds) and those the planner sent to AR."""

    drafted_steps: int
    drafted_tokens: int
    drafted_seconds: float
    ar_steps: int
    ar_seconds: float

    @property
    def drafted_ms(self) -> float | None:
        return 1000 * self.drafted_seconds / self.drafted_steps if self.drafted_steps else None

    @property
    def ar_ms(self) -> float | None:
        return 1000 * self.ar_seconds / self.ar_steps if self.ar_steps else None

    @property
    def speedup(self) -> float | None:
        """The drafted steps' tokens per second over the AR steps' (one token a step), both
        timed in this run; None unless it took both."""
        if self.drafted_ms is None or self.ar_ms is None or not self.drafted_seconds:
            return None
        return self.drafted_tokens / self.drafted_steps * self.ar_ms / self.drafted_ms
