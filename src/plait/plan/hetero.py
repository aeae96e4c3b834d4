"""Plans for clusters of unequal devices, after HetPipe (Park et al., USENIX ATC 2020).

Devices are grouped into pipelines ("virtual workers"): each data-parallel replica of a
plan is one pipeline over the devices its ranks land on. Each pipeline's stage partition
follows its own devices' speeds and memory (the exact partitioner with per-stage speeds
and caps), and the global batch is shared among pipelines in proportion to their
throughput, so that fast and slow pipelines finish their share at about the same time.
Two device orders are tried: one keeps a pipeline inside one kind of node (HetPipe's
node-partitioned virtual workers), the other spreads each pipeline across node kinds
(its "equal distribution").

Limits: replicas synchronise once per step (bulk-synchronous data parallelism, not
HetPipe's wave-synchronous staleness); the batch shares are whole micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from plait.cluster import Cluster, Device
from plait.cost import BlockCost, StageCost
from plait.plan.held import inflight
from plait.plan.partition import Partition, partition_blocks
from plait.plan.space import ModelSpec
from plait.sim import SimPlan, build_schedule
from plait.sim.replica import ReplicaRun, signature, simulate_replica

__all__ = ["HeteroPlan", "Replica", "plan_replicas", "shares", "split_replica"]


@dataclass(frozen=True)
class Replica:
    """One pipeline (virtual worker): its devices, stage split and share of the batch."""

    dp_rank: int
    devices: tuple[str, ...]  # device kind of each pipeline rank
    sizes: tuple[int, ...]  # blocks per stage
    num_microbatches: int
    bottleneck_s: float  # slowest stage's time per micro-batch
    run: ReplicaRun


@dataclass(frozen=True)
class HeteroPlan:
    plan: SimPlan  # num_microbatches is the total over replicas
    replicas: tuple[Replica, ...]

    @property
    def step_time_s(self) -> float:
        return max(r.run.step_time_s for r in self.replicas)

    @property
    def fits(self) -> bool:
        return all(
            rank.memory.total <= rank.capacity_bytes for r in self.replicas for rank in r.run.ranks
        )

    def batch_shares(self) -> list[float]:
        total = sum(r.num_microbatches for r in self.replicas)
        return [r.num_microbatches / total for r in self.replicas]


def shares(total: int, throughputs: list[float]) -> list[int]:
    """Split `total` micro-batches in proportion to `throughputs`, at least one each
    (largest remainders get the leftovers)."""
    if total < len(throughputs):
        raise ValueError(
            f"{total} micro-batches cannot feed {len(throughputs)} pipelines: use a larger "
            "global batch or fewer data-parallel replicas"
        )
    weight = sum(throughputs)
    exact = [total * t / weight for t in throughputs]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > total:  # rounding up to one each overshot: take from the others
        i = max(
            (j for j in range(len(counts)) if counts[j] > 1), key=lambda j: counts[j] - exact[j]
        )
        counts[i] -= 1
    order = sorted(range(len(counts)), key=lambda j: exact[j] - counts[j], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def split_replica(
    plan: SimPlan,
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    dp_rank: int = 0,
    *,
    explain: bool = True,
) -> tuple[list[Device], Partition]:
    """The devices of replica `dp_rank`'s stages and the fastest split of `blocks` over
    them within their memory (raises ValueError, naming the stage unless not `explain`,
    when none fits)."""
    k = plan.pp * plan.chunks
    if cluster.is_homogeneous:  # one device kind: no walk through the layout's ranks
        devices = [cluster.device(0)] * k
    else:
        devices = [cluster.device(plan.global_rank(s % plan.pp, dp_rank)) for s in range(k)]
    held = [inflight(plan.schedule, plan.pp, plan.microbatches, plan.chunks, s % plan.pp)
            for s in range(k)]  # fmt: skip
    part = partition_blocks(
        blocks, devices, dtype=plan.dtype, recompute=plan.recompute,
        inflight=[max(1, round(h)) for h in held], layout=plan, optimizer=plan.optimizer,
        offload_activations=plan.offload_activations, offload_optimizer=plan.offload_optimizer,
        explain=explain,
    )  # fmt: skip
    return devices, part


def plan_replicas(plan: SimPlan, model: ModelSpec, cluster: Cluster) -> HeteroPlan:
    """Partition each replica by its devices, share the batch by throughput, simulate.

    The step's micro-batches are `plan.shares` together: dp × `plan.microbatches`, or
    `plan.total_microbatches` where they do not divide equally. Replicas on the same kinds
    of devices are split once, and simulated once per share."""
    blocks = model.blocks_for(plan)
    kinds = [
        tuple(cluster.device(plan.global_rank(s, d)).name for s in range(plan.pp))
        for d in range(plan.dp)
    ]
    split: dict[tuple[str, ...], tuple[list[Device], Partition]] = {}
    for d, names in enumerate(kinds):
        if names not in split:
            split[names] = split_replica(plan, blocks, cluster, d)
    splits = [split[names] for names in kinds]
    counts = shares(sum(plan.shares), [1.0 / part.bottleneck_s for _, part in splits])
    runs: dict[tuple[Any, ...], ReplicaRun] = {}
    replicas = []
    for d, ((_, part), m) in enumerate(zip(splits, counts, strict=True)):
        alike = (m, signature(cluster, plan, d))  # what the replay of replica d depends on
        if alike not in runs:
            runs[alike] = _simulate_share(plan, blocks, part, cluster, m, d)
        replicas.append(Replica(d, kinds[d], tuple(part.sizes), m, part.bottleneck_s, runs[alike]))
    return HeteroPlan(plan, tuple(replicas))


def _simulate_share(
    plan: SimPlan, blocks: Sequence[BlockCost], part: Partition, cluster: Cluster, m: int, d: int
) -> ReplicaRun:
    mine = replace(plan, microbatches=m, total_microbatches=0)
    stage_list = [StageCost(tuple(s)) for s in part.split(list(blocks))]
    schedule = build_schedule(mine, check=False, lowered=False)
    if len(schedule.stage_to_rank) != len(stage_list):  # chunks, or a second direction
        raise ValueError(
            f"schedule={plan.schedule} runs {len(schedule.stage_to_rank)} stages on "
            f"{plan.pp} ranks; a pipeline split by its devices' speeds has one stage a rank"
        )
    return simulate_replica(schedule, stage_list, cluster, mine, d)
