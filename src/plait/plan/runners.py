"""The runner-up of each schedule kind a search tried, and what would make it win.

For every kind other than the winner's, the fastest plan of that kind: the simulator's
prediction when the search simulated one, else the closed-form estimate (`source` says
which). What would change the choice is found by predicting the runner-up and the winner again,
on their cuts, with more or fewer micro-batches per replica (the same micro-batch size, so
a larger or smaller global batch): by the simulator where the plans are small, else by
the closed-form estimate shifted by what it misses of its plan's prediction at today's
count, so that both sides stay on the simulator's scale. Limits: only the
micro-batch count is varied; a count where the runner-up would not fit memory (by the
estimate) does not count as a win, nor does one by less than `MARGIN` of the step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

from plait.cluster import Cluster
from plait.cost import StageCost
from plait.plan.estimate import Estimator
from plait.plan.io import LAYOUT_KEYS
from plait.plan.search import PlanSearch, describe
from plait.plan.space import ModelSpec
from plait.schedule.pause import gc_paused
from plait.sim import SimPlan, build_schedule, simulate

__all__ = ["FACTORS", "MARGIN", "SIMULATED_ACTIONS", "RunnerUp", "runners_up", "runners_up_text"]

# micro-batch counts tried, as multiples of the runner-up's own
FACTORS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2, 4, 8, 16)
# a win counts when it is by more than this share of the step: closer than that, the
# extrapolated estimates cannot tell the two plans apart
MARGIN = 0.005
# plans of at most this many stage passes a step (pp × chunks × micro-batches) are
# simulated at the other counts; larger ones estimated
SIMULATED_ACTIONS = 4096


@dataclass(frozen=True)
class RunnerUp:
    """The fastest plan of one schedule kind that lost, and what would make it win."""

    kind: str
    plan: SimPlan
    sizes: tuple[int, ...]  # blocks per (virtual) stage
    step_time_s: float
    source: str  # "simulator" or "estimate"
    would_win_if: str

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `plait plan --json` lists under `runners_up`."""
        values = self.plan.to_dict()
        plan = {key: values[key] for key in LAYOUT_KEYS if key in values}
        plan.pop("pipelines", None)
        plan["partition"] = list(self.sizes)
        plan["micro_batch_size"] = self.plan.micro_batch_size
        plan["global_batch"] = self.plan.global_batch_size
        return {
            "kind": self.kind,
            "predicted_step_s": self.step_time_s,
            "source": self.source,
            "plan": plan,
            "would_win_if": self.would_win_if,
        }


@gc_paused()  # as `search`: many objects, no cycles
def runners_up(search: PlanSearch, model: ModelSpec, cluster: Cluster) -> tuple[RunnerUp, ...]:
    """One runner-up per schedule kind the search tried, other than the winner's, fastest
    first."""
    best = search.best
    predict = _Predictions(model, Estimator(cluster))
    simulated: dict[str, tuple[SimPlan, tuple[int, ...], float]] = {}
    for r in search.ranked:  # fastest (then simplest) first
        simulated.setdefault(r.plan.schedule, (r.plan, r.sizes, r.step_time_s))
    estimated = {p.schedule: (p, e.sizes, e.step_s) for e, p in search.kind_estimates}
    out = []
    for kind in dict.fromkeys([*simulated, *estimated]):
        if kind == best.plan.schedule:
            continue
        source = "simulator" if kind in simulated else "estimate"
        plan, sizes, step = simulated[kind] if kind in simulated else estimated[kind]
        why = _would_win_if(plan, sizes, step, best.plan, best.sizes, best.step_time_s,
                            predict)  # fmt: skip
        out.append(RunnerUp(kind, plan, sizes, step, source, why))
    return tuple(sorted(out, key=lambda r: r.step_time_s))


_Scaled = tuple[float, bool, bool] | None


class _Predictions:
    """`_scaled`'s answers kept for the search's one explanation: the winner is predicted
    again at every count for each runner-up, the same plans each time."""

    def __init__(self, model: ModelSpec, est: Estimator) -> None:
        self.model, self.est = model, est
        self.kept: dict[tuple[SimPlan, tuple[int, ...], float], _Scaled] = {}

    def __call__(self, plan: SimPlan, sizes: tuple[int, ...], factor: float) -> _Scaled:
        key = (plan, sizes, factor)
        if key not in self.kept:
            self.kept[key] = _scaled(plan, sizes, self.model, self.est, factor)
        return self.kept[key]


def _scaled(
    plan: SimPlan, sizes: tuple[int, ...], model: ModelSpec, est: Estimator, factor: float
) -> _Scaled:
    """(predicted step, fits, by the simulator) of `plan` with `factor` × its micro-batches
    on its cut, or None when that count is no valid plan. Small plans (at most
    `SIMULATED_ACTIONS` passes per step) are simulated, larger ones estimated."""
    m = round(plan.microbatches * factor)
    if m < 1 or (m == plan.microbatches and factor != 1):
        return None
    try:
        changed = dataclasses.replace(plan, microbatches=m)
    except ValueError:
        return None
    blocks = model.blocks_for(changed)
    if changed.pp * changed.chunks * m <= SIMULATED_ACTIONS and est.cluster.is_homogeneous:
        cut = [StageCost(tuple(blocks[a:b])) for a, b in pairwise(accumulate(sizes, initial=0))]
        result = simulate(
            build_schedule(changed, check=False, lowered=False), cut, est.cluster, changed
        )
        return result.step_time_s, result.fits, True
    e = est.estimate_cut(changed, blocks, sizes)
    return e.step_s, e.fits, False


def _would_win_if(
    plan: SimPlan,
    sizes: tuple[int, ...],
    step: float,
    best: SimPlan,
    best_sizes: tuple[int, ...],
    best_step: float,
    predict: _Predictions,
) -> str:
    """Where, over micro-batch counts, the runner-up's predicted step beats the winner's."""
    here, there = predict(plan, sizes, 1), predict(best, best_sizes, 1)
    assert here is not None and there is not None
    # an estimate's slope over micro-batches (its slowest rank's time) is the simulator's;
    # what it misses of fill, drain and collectives is taken to stay the same
    offset, best_offset = step - here[0], best_step - there[0]
    wins = []
    for f in FACTORS:
        mine, theirs = predict(plan, sizes, f), predict(best, best_sizes, f)
        if mine is None or theirs is None or not mine[1]:
            continue
        a = mine[0] + (0.0 if mine[2] else offset)
        b = theirs[0] + (0.0 if theirs[2] else best_offset)
        wins.append((f, a < b * (1 - MARGIN)))
    more = [f for f, won in wins if won and f > 1]
    fewer = [f for f, won in wins if won and f < 1]
    m = plan.microbatches
    if more and all(won for f, won in wins if f >= min(more)):
        n = round(m * min(more))
        return f"{plan.schedule} would win at {_count(n)} per replica or more (now {m})"
    if fewer and all(won for f, won in wins if f <= max(fewer)):
        n = round(m * max(fewer))
        return f"{plan.schedule} would win at {_count(n)} per replica or fewer (now {m})"
    if more or fewer:
        counts = ", ".join(str(round(m * f)) for f in sorted(more + fewer))
        return f"{plan.schedule} would win at {counts} micro-batches per replica (now {m})"
    lo, hi = max(1, round(m * FACTORS[0])), round(m * FACTORS[-1])
    return f"{plan.schedule} would not win at any of {lo} to {hi} micro-batches per replica"


def _count(n: int) -> str:
    return f"{n} micro-batch" + ("" if n == 1 else "es")


def runners_up_text(runners: tuple[RunnerUp, ...]) -> str:
    """One line per kind: its fastest plan, its predicted step, what would make it win."""
    if not runners:
        return ""
    lines = ["Runner-up of each other schedule kind:"]
    for r in runners:
        how = "simulated" if r.source == "simulator" else "estimated"
        lines.append(
            f"  {r.kind}: {describe(r.plan)}, {r.step_time_s:.4g} s per step ({how}); "
            f"{r.would_win_if}."
        )
    return "\n".join(lines)
