"""A predicted step: partition a model's blocks into a plan's stages and simulate one step
on a cluster (what `plait simulate` prints and `plait train` checks memory by)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate, pairwise

from plait.cluster import Cluster
from plait.cost import BlockCost, StageCost
from plait.plan.partition import Partition, partition, partition_blocks
from plait.schedule import Schedule, validate
from plait.sim import SimPlan, SimResult, build_schedule, simulate

__all__ = ["Prediction", "predict", "scaled_cluster"]


@dataclass(frozen=True)
class Prediction:
    """A simulated step and how it was set up."""

    result: SimResult
    partition: Partition
    schedule: Schedule
    cluster: Cluster


def scaled_cluster(cluster: Cluster, num_devices: int) -> Cluster:
    """`cluster` with enough nodes of its kind for `num_devices` ranks."""
    if len(cluster.groups) == 1:
        per_node = cluster.groups[0].devices_per_node
        return cluster.with_nodes(max(1, math.ceil(num_devices / per_node)))
    if cluster.num_devices < num_devices:
        raise ValueError(
            f"dp × tp × pp = {num_devices} ranks but cluster {cluster.name!r} has "
            f"{cluster.num_devices} devices: add nodes to its file or shrink the plan"
        )
    return cluster


def _inflight(schedule: Schedule) -> list[int]:
    """Micro-batches each stage holds at its peak (unit costs), for the memory caps."""
    peak = validate(schedule).peak_inflight
    v = schedule.num_chunks
    return [max(1, math.ceil(peak[r] / v)) for r in schedule.stage_to_rank]


def _partition(
    blocks: list[BlockCost], schedule: Schedule, cluster: Cluster, plan: SimPlan
) -> Partition:
    """The fastest split whose stages fit; if none fits, the fastest split. A split into
    model parts, each placed as its first replica (a stage per part unless replicated)."""
    first = [schedule.replicas(k)[0] for k in range(schedule.num_parts)]
    devices = [cluster.device(plan.global_rank(schedule.stage_to_rank[s])) for s in first]
    inflight = _inflight(schedule)
    try:
        return partition_blocks(
            blocks,
            devices,
            dtype=plan.dtype,
            recompute=plan.recompute,
            inflight=[inflight[s] for s in first],
            layout=plan,
            optimizer=plan.optimizer,
        )
    except ValueError:
        work = [
            b.forward_flops
            + b.backward_input_flops
            + b.backward_weight_flops
            + b.recompute_flops(plan.recompute)
            for b in blocks
        ]
        speeds = [d.achievable_flops(plan.dtype) for d in devices]
        return partition(work, len(devices), speeds=speeds)


def predict(blocks: list[BlockCost], cluster: Cluster, plan: SimPlan) -> Prediction:
    """Partition `blocks` into the plan's stages and simulate one step on `cluster`."""
    schedule = build_schedule(plan)
    if len(blocks) < schedule.num_parts:
        raise ValueError(
            f"pp × chunks = {schedule.num_parts} stages but the model has only {len(blocks)} "
            "blocks: use fewer pipeline ranks or chunks, or more layers"
        )
    if plan.partition is None:
        cut = _partition(blocks, schedule, cluster, plan)
    else:  # the plan's own cut (`plait plan` wrote it, training runs it)
        cut = _given(plan.partition, blocks, schedule, cluster, plan)
    stages = [StageCost(tuple(s)) for s in cut.split(blocks)]
    result = simulate(schedule, stages, cluster, plan)
    return Prediction(result, cut, schedule, cluster)


def _given(
    sizes: tuple[int, ...],
    blocks: list[BlockCost],
    schedule: Schedule,
    cluster: Cluster,
    plan: SimPlan,
) -> Partition:
    """The cut `sizes`, each part timed at its first stage's device under its mode (its
    memory is what the simulator then says)."""
    if sum(sizes) != len(blocks):
        raise ValueError(
            f"partition={list(sizes)} cuts {sum(sizes)} blocks but the model has {len(blocks)}: "
            "give a partition of this model, or none to have one chosen"
        )
    bounds = [0, *accumulate(sizes)]
    times = []
    for k, (a, b) in enumerate(pairwise(bounds)):
        device = cluster.device(plan.global_rank(schedule.stage_to_rank[schedule.replicas(k)[0]]))
        mode = plan.recompute_of(k)
        work = sum(x.forward_flops + x.backward_input_flops + x.backward_weight_flops
                   + x.recompute_flops(mode) for x in blocks[a:b])  # fmt: skip
        times.append(work / device.achievable_flops(plan.dtype))
    return Partition(tuple(bounds), tuple(times), (math.nan,) * len(sizes))
