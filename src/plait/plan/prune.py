"""The bounds that prune the planner's candidates before their closed-form estimates.

The search (`plait.plan.search`) simulates only the candidates its estimates rank first,
and the explanation names the fastest of each schedule kind. A candidate whose lower bound
on the step (`plait.plan.estimate.bound`: m times its slowest rank's compute) is already
slower than the estimates that could still be simulated and than its kind's fastest
cannot be either, so it is never estimated in full; one whose memory (computed by the bound
exactly as the estimate computes it) does not fit is set aside as a misfit. The order of
the estimates that remain, and therefore the search's choice, is what estimating every
candidate would give.
"""

from __future__ import annotations

import heapq
import math

from plait.cluster import Cluster
from plait.plan.estimate import Estimate, Estimator
from plait.plan.loader import replica_batch
from plait.plan.space import ModelSpec
from plait.sim import SimPlan

__all__ = ["fastest_of_each_kind", "order_key", "pruned_estimates"]


def pruned_estimates(
    plans: list[SimPlan], model: ModelSpec, cluster: Cluster, keep: int | None, rate: float | None
) -> tuple[list[tuple[Estimate, SimPlan]], list[tuple[Estimate, SimPlan]]]:
    """(estimates, misfits): the estimates of every plan when `keep` is None (an exhaustive
    search), else only of the plans that could be among the `keep` fastest estimates or the
    fastest of their schedule kind, pruned by bounds: a plan whose memory (which the bound
    computes exactly as the estimate) does not fit is a misfit, and one whose lower bound
    on the step (`plait.plan.estimate.bound`) is slower than the `keep`-th fastest estimate
    so far and than its kind's fastest is never estimated, as it could not be simulated."""
    est = Estimator(cluster)
    if keep is None:
        return [(est.estimate(p, model.blocks_for(p)), p) for p in plans], []
    bounds = [(est.bound(p, model.blocks_for(p)), p) for p in plans]
    misfits = [(b, p) for b, p in bounds if not b.fits]
    fitting = sorted(
        (x for x in bounds if x[0].fits), key=lambda x: order_key(x[0].step_s, x[1], rate)
    )
    fastest: list[float] = []  # the `keep` fastest estimated steps, a max-heap by negation
    by_kind: dict[str, float] = {}
    out = []
    kinds = {p.schedule for _, p in fitting}
    for lower, plan in fitting:
        floor = order_key(lower.step_s, plan, rate)
        full = len(fastest) >= keep and floor > -fastest[0]
        if full and floor > by_kind.get(plan.schedule, math.inf):
            if len(by_kind) == len(kinds) and floor > max(by_kind.values()):
                break  # bounds only grow from here on
            continue
        e = est.estimate(plan, model.blocks_for(plan))
        key = order_key(e.step_s, plan, rate)
        heapq.heappush(fastest, -key)
        if len(fastest) > keep:
            heapq.heappop(fastest)
        by_kind[plan.schedule] = min(key, by_kind.get(plan.schedule, math.inf))
        out.append((e, plan))
    return out, misfits


def order_key(step_s: float, plan: SimPlan, rate: float | None) -> float:
    """What the search orders by: the step, or the input's time when that is longer."""
    return max(step_s, replica_batch(plan) / rate) if rate else step_s


def fastest_of_each_kind(
    estimates: list[tuple[Estimate, SimPlan]], rate: float | None
) -> tuple[tuple[Estimate, SimPlan], ...]:
    """The fastest estimate that fits of each schedule kind, fastest first."""
    best: dict[str, tuple[Estimate, SimPlan]] = {}
    for e, p in estimates:
        if e.fits and (
            p.schedule not in best
            or order_key(e.step_s, p, rate)
            < order_key(best[p.schedule][0].step_s, best[p.schedule][1], rate)
        ):
            best[p.schedule] = (e, p)
    return tuple(sorted(best.values(), key=lambda x: order_key(x[0].step_s, x[1], rate)))
