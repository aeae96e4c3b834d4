"""Simulate one training step of a plan: every distinct data-parallel replica, then metrics.

`simulate` is the entry point: a schedule (any kind, from `plait.schedule.build` or a
hand-written one), one cost per (virtual) stage, a cluster and a `SimPlan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from plait.cluster import Cluster
from plait.cost import BlockCost, StageCost
from plait.schedule import Schedule, build, validate
from plait.sim.plan import SimPlan
from plait.sim.replica import ReplicaRun, signature, simulate_replica
from plait.sim.result import MemoryOverflow, SimResult

__all__ = ["build_schedule", "simulate"]


def build_schedule(plan: SimPlan, *, check: bool = True, lowered: bool = True) -> Schedule:
    """The lowered schedule `plan` names (kind, pp, micro-batches, chunks), validated
    unless `check` is False; with `lowered=False` its form before sends and receives are
    inserted, which `simulate` replays to the same prediction in less than half the time
    (the planner's). Schedules are immutable and the planner simulates many plans
    that share one (they differ in ZeRO, recomputation, data parallelism), so the last
    few built are kept."""
    schedule = _built(*_shape(plan), lowered)
    if check:
        validate(schedule if lowered else _built(*_shape(plan), True))
    return schedule


def _shape(plan: SimPlan) -> tuple[str, int, int, int]:
    return plan.schedule, plan.pp, plan.microbatches, plan.chunks


@lru_cache(maxsize=8)
def _built(kind: str, pp: int, microbatches: int, chunks: int, lowered: bool) -> Schedule:
    return build(kind, pp, microbatches, chunks, check=False, lowered=lowered)


def _check(schedule: Schedule, num_stages: int, cluster: Cluster, plan: SimPlan) -> None:
    if schedule.num_ranks != plan.pp:
        raise ValueError(
            f"the schedule has {schedule.num_ranks} pipeline ranks but plan.pp={plan.pp}: "
            "build the schedule with num_stages=pp (see build_schedule)"
        )
    if num_stages != schedule.num_stages:
        raise ValueError(
            f"{num_stages} stage costs for a schedule of {schedule.num_stages} stages "
            f"(pp × chunks): partition the blocks into {schedule.num_stages} stages"
        )
    if schedule.num_microbatches != plan.microbatches:
        raise ValueError(
            f"the schedule runs {schedule.num_microbatches} micro-batches but "
            f"plan.microbatches={plan.microbatches}: make them agree"
        )
    if cluster.num_devices < plan.world_size:
        raise ValueError(
            f"the plan needs dp·cp·tp·pp = {plan.world_size} devices but cluster "
            f"{cluster.name!r} has {cluster.num_devices}: add nodes or shrink the plan"
        )


def _overflows(cluster: Cluster, plan: SimPlan, runs: list[ReplicaRun]) -> list[MemoryOverflow]:
    found = []
    # a need within the smallest device fits every rank: most plans, without a walk over
    # all dp·tp·pp ranks
    smallest = min(g.device.memory_bytes for g in cluster.groups)
    for dp_rank, run in enumerate(runs):
        for report in run.ranks:
            need = report.memory.total
            if need <= smallest:
                continue
            for tp_rank in range(plan.tp):
                rank = plan.global_rank(report.pp_rank, dp_rank, tp_rank)
                capacity = cluster.device(rank).memory_bytes
                if need > capacity:
                    found.append(MemoryOverflow(rank, report.pp_rank, need, float(capacity)))
    return found


def _peak(cluster: Cluster, world_size: int, dtype: str) -> float:
    """Peak FLOP/s of the first `world_size` ranks, added rank by rank (as before, to the
    last bit) but with each group's device looked up once."""
    total, first = 0.0, 0
    for group in cluster.groups:
        peak = group.device.peak(dtype)
        for _ in range(min(group.num_devices, max(0, world_size - first))):
            total += peak
        first += group.num_devices
    return total


def simulate(
    schedule: Schedule,
    stages: Sequence[StageCost | BlockCost],
    cluster: Cluster,
    plan: SimPlan,
) -> SimResult:
    """Predict one step of `plan` running `schedule` with `stages[s]` as the cost of
    (virtual) stage s, or of model part s when the schedule replicates parts (Chimera:
    each replica costs as its part, and its update waits for its replicas' gradients to be
    summed), on the
    first dp·tp·pp ranks of `cluster`.

    Replicas on identical hardware are replayed once. The step ends when the slowest
    replica's last optimizer step ends (for an asynchronous schedule: the slowest
    replica's window period in the steady state); memory is checked on every global rank.
    """
    parts = [StageCost.of(s) for s in stages]
    stage_list = parts
    if len(parts) == schedule.num_parts != schedule.num_stages:  # a cost per model part:
        stage_list = [parts[k] for k in schedule.parts]  # replicas cost as their part
    _check(schedule, len(stage_list), cluster, plan)
    cache: dict[tuple[object, ...], ReplicaRun] = {}
    runs = []
    for dp_rank in range(plan.dp):
        key = signature(cluster, plan, dp_rank)
        if key not in cache:
            cache[key] = simulate_replica(schedule, stage_list, cluster, plan, dp_rank)
        runs.append(cache[key])
    worst = max(cache.values(), key=lambda run: run.step_time_s)
    step = worst.step_time_s  # a synchronous step, or an asynchronous window in steady state
    m = plan.microbatches
    model_flops = sum(st.model_flops for st in parts) * m * plan.tp * plan.cp * plan.dp
    peak = _peak(cluster, plan.world_size, plan.dtype)
    span = worst.pipeline_time_s
    return SimResult(
        plan=plan,
        step_time_s=step,
        pipeline_time_s=span,
        bubble_fraction=1.0 - worst.busy_s / (plan.pp * span) if span > 0 else 0.0,
        ranks=worst.ranks,
        overflows=tuple(_overflows(cluster, plan, runs)),
        model_flops=model_flops,
        samples_per_s=plan.global_batch_size / step if step > 0 else 0.0,
        tokens_per_s=plan.global_batch_size * plan.seq_len / step if step > 0 else 0.0,
        mfu=model_flops / (step * peak) if step > 0 else 0.0,
        comm_share=sum(r.comm_s for r in worst.ranks) / (plan.pp * step) if step > 0 else 0.0,
        replay=worst.replay,
    )
