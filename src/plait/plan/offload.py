"""Offloading inside the search: plans that fit device memory only with their activations or
optimizer state in host memory (`plait.train.offload`) compete with the plans that fit.

A plan set aside for memory is tried again with an offload option only when it could still
win. For each option the bounds are computed as the estimate computes memory
(`plait.plan.estimate`): the plan's memory without what the option moves must fit (an
optimistic floor: the one block whose activations stay on the device while it computes is
not counted), and its step is at least each rank's m micro-batches of compute plus the host
link's time for what it moves (the simulator charges offloaded activations once out in
forward and once in for backward of every micro-batch, and swapped optimizer state in and
out once a step, `plait.sim.replica`). Options are replayed exactly in the order of those
bounds, best first, so the first bound that is not below the best step found ends the
search with nothing left that could win; `limit` replays and a `budget` of replayed
stage-micro-batches cap it as the search's own stop does (at least one replay is made: a
64-stage pipeline of 512 micro-batches is over the whole budget alone).

Why not offload every candidate as one more dimension of the space: each option only adds
host-link time to a plan that fits without it, so it can win only where memory forces a
slower plan (more recomputation, sharding or stages), and the bounds find those few among
tens of thousands of misfits.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Mapping
from typing import Any

from plait.cluster import Cluster, dtype_bytes
from plait.cost import expert_dp_degree, model_state_bytes, shard_degree
from plait.plan.estimate import Estimator
from plait.plan.exact import RankedPlan, Rejection, exact_of
from plait.plan.prune import order_key
from plait.plan.space import ModelSpec
from plait.schedule import schedule_kind
from plait.sim import SimPlan

__all__ = ["OPTIONS", "best_key_of", "offload_bounds", "offloaded", "offloads"]

# the three ways to move memory to the host, cheapest host traffic first
OPTIONS: tuple[Mapping[str, Any], ...] = (
    {"offload_optimizer": True},
    {"offload_activations": "all"},
    {"offload_activations": "all", "offload_optimizer": True},
)


def offloads(plan: SimPlan) -> bool:
    """Whether `plan` moves anything to host memory."""
    return plan.offload_optimizer or plan.offload_activations != "none"


def _optimizer_per_param(plan: SimPlan, experts: bool) -> tuple[float, float]:
    """(least, most) optimizer-state bytes a parameter holds on a rank: dense parameters
    are sharded over the plan's ZeRO degree, experts over the ranks holding the same ones."""
    big = 1e9
    degrees = {shard_degree(plan), *([expert_dp_degree(plan)] if experts else [])}
    per = [
        model_state_bytes(big, dtype=plan.dtype, zero_stage=plan.zero, dp=dp,
                          optimizer=plan.optimizer).optimizer / big
        for dp in degrees
    ]  # fmt: skip
    return min(per), max(per)


def offload_bounds(
    plan: SimPlan, model: ModelSpec, est: Estimator, capacity: float
) -> list[tuple[float, Mapping[str, Any]]]:
    """(lower bound on the step, option) for each option under which some cut of `plan`'s
    blocks could fit in `capacity` bytes a device (see the module docstring). The exact
    search cuts the blocks within memory (`plait.plan.partition`), so both bounds hold for
    any cut: memory summed over the ranks (what any cut holds at the least, as
    `plait.plan.estimate.bound` counts it, less what the option moves) within the ranks'
    capacity summed, and the step at least the balanced cut's m × slowest compute and the
    ranks' average of compute and transfers (the totals do not depend on the cut)."""
    blocks = model.blocks_for(plan)
    profile = est.profile(plan, blocks)
    kind = schedule_kind(plan.schedule)
    p, m, v = plan.pp, plan.microbatches, plan.chunks
    least_held = min(kind.inflight(p, m, v, r) for r in range(p))
    copies = min(kind.copies(p, m, r) for r in range(p))
    params = float(profile.params.sum())
    state = params * est.state_per_param(plan) * (2 if kind.replicated else 1)
    least, most = _optimizer_per_param(plan, profile.experts is not None)
    saved = float(profile.saved.sum())
    held = {"optimizer": params * most, "activations": least_held * saved}
    floor = state + held["activations"] + copies * params * dtype_bytes(plan.dtype)
    host = est.device.host_bandwidth_Bps
    work = profile.forward_s + profile.backward_input_s + profile.backward_weight_s
    compute = m * float(work.max())
    out = []
    for option in OPTIONS:
        parts = [k for k in ("optimizer", "activations") if _moves(option, k)]
        if floor - sum(held[k] for k in parts) > p * capacity:
            continue
        total = m * float(work.sum())
        if "optimizer" in parts:
            total += 2 * params * least / host
        if "activations" in parts:
            total += m * 2 * saved / host
        out.append((max(compute, total / p), option))
    return out


def _moves(option: Mapping[str, Any], part: str) -> bool:
    return bool(option.get("offload_optimizer")) if part == "optimizer" else (
        option.get("offload_activations", "none") != "none")  # fmt: skip


def offloaded(
    failed: Iterable[tuple[float | None, SimPlan]],
    best_key: float,
    model: ModelSpec,
    cluster: Cluster,
    *,
    margin: float,
    limit: int,
    rate: float | None,
    budget: int | None = None,
) -> list[RankedPlan | Rejection]:
    """Replay with offload the plans of `failed` ((lower bound on the step, plan) pairs of
    plans that did not fit; None: the bound is computed here) that could beat `best_key`
    (the best fitting step, in the search's order), best bound first, at most `limit`
    replays, and (with a `budget`) none after `budget` stage-micro-batches. Returns their
    outcomes; the caller applies the memory margin to them as to any plan. Pipelines of
    their own are not offloaded (`plait.pipelines.check_hetero_plan`)."""
    est = Estimator(cluster)
    capacity = est.device.memory_bytes * (1 - margin)
    pending = sorted(
        (
            (order_key(est.bound(p, model.blocks_for(p)).step_s if s is None else s, p, rate),
             i, p)
            for i, (s, p) in enumerate(failed)
            if p.pipelines is None and not offloads(p)
        ),
        key=lambda x: x[:2],
    )  # fmt: skip
    head = 0
    queue: list[tuple[float, int, int, SimPlan, Mapping[str, Any]]] = []
    out: list[RankedPlan | Rejection] = []
    best, n, tried, spent = best_key, 0, 0, 0
    while tried < limit and (budget is None or tried == 0 or spent < budget):
        # every pending plan's options are bounded below by its compute bound, so the
        # queue's head is the best left once it is not above the next pending plan's
        while (
            head < len(pending)
            and pending[head][0] < best
            and (not queue or queue[0][0] > pending[head][0])
        ):
            _, i, plan = pending[head]
            head += 1
            for step, option in offload_bounds(plan, model, est, capacity):
                n += 1
                heapq.heappush(queue, (order_key(step, plan, rate), i, n, plan, option))
        if not queue or queue[0][0] >= best:
            break
        _, _, _, plan, option = heapq.heappop(queue)
        outcome = exact_of(plan, cluster)(dataclasses.replace(plan, **option), model, cluster)
        tried += 1
        spent += plan.pp * plan.chunks * plan.microbatches
        out.append(outcome)
        if isinstance(outcome, RankedPlan) and all(
            c - p >= margin * c
            for c, p in zip(outcome.capacity_bytes, outcome.peak_memory_bytes, strict=True)
        ):
            best = min(best, order_key(outcome.step_time_s, outcome.plan, rate))
    return out


def best_key_of(ranked: Iterable[RankedPlan]) -> float:
    """The best step among `ranked` in the search's order (inf when none)."""
    return min((r.step_time_s for r in ranked), default=math.inf)
