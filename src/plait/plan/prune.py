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

import contextlib
import heapq
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import cast

from plait.cluster import Cluster
from plait.cost import BlockCost
from plait.plan.estimate import Estimate, Estimator, RankProfile, bounds
from plait.plan.hetero import split_replica
from plait.plan.loader import replica_batch
from plait.plan.partition import blocks_fit
from plait.plan.space import ModelSpec
from plait.schedule import schedule_kind
from plait.sim import SimPlan

__all__ = [
    "bounds_of",
    "fastest_of_each_kind",
    "fastest_without_cp",
    "order_key",
    "pruned_estimates",
    "uneven_cut",
]


def pruned_estimates(
    plans: list[SimPlan], model: ModelSpec, cluster: Cluster, keep: int | None, rate: float | None
) -> tuple[list[tuple[Estimate, SimPlan]], list[tuple[Estimate, SimPlan]]]:
    """(estimates, misfits): the estimates of every plan when `keep` is None (an exhaustive
    search), else only of the plans that could be among the `keep` fastest estimates or the
    fastest of their schedule kind, pruned by bounds: one whose lower bound on the step
    (`plait.plan.estimate.bound`) is slower than the `keep`-th fastest estimate so far and
    than its kind's fastest is never estimated, as it could not be simulated. A plan whose
    balanced cut does not fit memory is cut unevenly (`uneven_cut`) and estimated so when
    that fits and it could be among the `keep` fastest, else it is a misfit (the fastest
    of a kind is looked for among balanced cuts only: cutting is the costly part)."""
    est = Estimator(cluster)
    if keep is None:
        return [(est.estimate(p, model.blocks_for(p)), p) for p in plans], []
    bounds = sorted(
        zip(bounds_of(plans, model, est), plans, strict=True),
        key=lambda x: order_key(x[0].step_s, x[1], rate),
    )
    fastest: list[float] = []  # the `keep` fastest estimated steps, a max-heap by negation
    by_kind: dict[str, float] = {}
    out, misfits = [], []
    kinds = {p.schedule for p in plans}
    for i, (lower, plan) in enumerate(bounds):
        floor = order_key(lower.step_s, plan, rate)
        full = len(fastest) >= keep and floor > -fastest[0]
        if full and floor > by_kind.get(plan.schedule, math.inf):
            if len(by_kind) == len(kinds) and floor > max(by_kind.values()):
                misfits += [(b, p) for b, p in bounds[i:] if not b.fits]
                break  # bounds only grow from here on
            if not lower.fits:
                misfits.append((lower, plan))
            continue
        e = est.estimate(plan, model.blocks_for(plan)) if lower.fits else None
        if e is None and lower.other_cut_may_fit and not full:  # one that could be simulated
            e = uneven_cut(plan, model, cluster, est)
        if e is None or not e.fits:
            misfits.append((lower, plan))
            continue
        key = order_key(e.step_s, plan, rate)
        heapq.heappush(fastest, -key)
        if len(fastest) > keep:
            heapq.heappop(fastest)
        by_kind[plan.schedule] = min(key, by_kind.get(plan.schedule, math.inf))
        out.append((e, plan))
    return out, misfits


def bounds_of(plans: Sequence[SimPlan], model: ModelSpec, est: Estimator) -> list[Estimate]:
    """`est.bound` of each of `plans`, those that share a balanced cut bounded together
    (`plait.plan.estimate.bounds`)."""
    out: list[Estimate | None] = [None] * len(plans)
    groups: dict[int, tuple[RankProfile, list[int]]] = {}
    for i, plan in enumerate(plans):
        profile = est.profile(plan, model.blocks_for(plan))
        groups.setdefault(id(profile), (profile, []))[1].append(i)
    for profile, rows in groups.values():
        for i, e in zip(rows, bounds([plans[i] for i in rows], profile, est), strict=True):
            out[i] = e
    return cast(list[Estimate], out)


def uneven_cut(
    plan: SimPlan, model: ModelSpec, cluster: Cluster, est: Estimator
) -> Estimate | None:
    """The estimate of `plan` on the cut the exact search will simulate (`split_replica`:
    the fastest cut within each rank's memory, with fewer blocks where more micro-batches
    are held, as on 1F1B's first stage), or None when no cut fits."""
    blocks = model.blocks_for(plan)
    key: tuple[object, ...]
    if cluster.is_homogeneous:  # the cut depends on the plan only through these
        counts = _counts(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
        key = (id(blocks), plan.pp, plan.chunks, plan.recompute, plan.dtype, plan.zero,
               plan.layout, plan.optimizer, plan.ep, counts)  # fmt: skip
    else:
        key = (id(blocks), plan)
    if key not in est.cuts:
        est.cuts[key] = None
        if _some_cut_fits(plan, blocks, cluster):  # a necessary condition, far cheaper
            with contextlib.suppress(ValueError):  # as the greedy pass, to rounding
                est.cuts[key] = split_replica(plan, blocks, cluster, explain=False)[1].sizes
    sizes = est.cuts[key]
    return None if sizes is None else est.estimate_cut(plan, blocks, sizes)


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


def fastest_without_cp(
    estimates: list[tuple[Estimate, SimPlan]], plans: list[SimPlan], rate: float | None
) -> tuple[Estimate, SimPlan] | None:
    """The fastest fitting estimate with cp=1, or None (also when no plan has cp > 1)."""
    if all(p.cp == 1 for p in plans):
        return None
    fitting = [(e, p) for e, p in estimates if p.cp == 1 and e.fits]
    return min(fitting, key=lambda x: order_key(x[0].step_s, x[1], rate), default=None)


@lru_cache(maxsize=4096)
def _counts(kind: str, p: int, m: int, v: int) -> tuple[float, ...]:
    """Per pipeline rank, the micro-batches whose activations it holds at its peak (the
    kind's closed form, as `partition` is given them), for each of a few hundred shapes."""
    return tuple(schedule_kind(kind).inflight(p, m, v, r) for r in range(p))


def _some_cut_fits(plan: SimPlan, blocks: Sequence[BlockCost], cluster: Cluster) -> bool:
    k = plan.pp * plan.chunks
    counts = _counts(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
    held = [max(1, round(counts[s % plan.pp])) for s in range(k)]
    if cluster.is_homogeneous:  # one device kind: no walk through the layout's ranks
        devices = [cluster.device(0)] * k
    else:
        devices = [cluster.device(plan.global_rank(s % plan.pp)) for s in range(k)]
    return blocks_fit(blocks, devices, inflight=held, dtype=plan.dtype,
                      recompute=plan.recompute, layout=plan, optimizer=plan.optimizer)  # fmt: skip
