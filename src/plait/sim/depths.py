"""One pipeline of a plan whose pipelines differ in depth, replayed on its own ranks.

HetPipe (Park et al., USENIX ATC 2020) joins virtual workers of unequal size by data
parallelism. Such pipelines have no (dp, pp) grid: they take consecutive global ranks
(`plait.pipelines.pipeline_layout`). Each is replayed as a plan of pp = its depth and
dp = 1 on a cluster of its own ranks (`own_cluster`), and each stage's `REDUCE` costs the
all-reduce of its blocks' gradients over the ranks that hold the same blocks in every
pipeline, one reduction per group of blocks held alike (as `plait.parallel.hetero`
groups them), priced as the equal-depth replay prices a stage's data-parallel reduction
(`stage_sync_time` on the group's bottleneck link, degree = the number of pipelines).

Limits: as in the equal-depth replay, the pipelines are assumed to reach each reduction
together (a pipeline that finishes early does not wait in its replay); devices that
time-share processors across pipelines are not modelled (`own_cluster` refuses them).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.cluster import Cluster, Link, NodeGroup, dtype_bytes
from plait.cost import AxisLinks, BlockCost, StageCost, stage_sync_time
from plait.pipelines import PipelineLayout
from plait.schedule import Schedule
from plait.sim.plan import SimPlan
from plait.sim.replica import ReplicaRun, _Replica

__all__ = ["own_cluster", "reduce_times", "simulate_pipeline"]


def own_cluster(cluster: Cluster, ranks: Sequence[int]) -> Cluster:
    """The devices of `ranks` (consecutive global ranks) as a cluster of their own: rank i
    of it is `ranks[i]`, on the same kind of device, node and links."""
    if cluster.shares_processors:
        raise ValueError(
            f"cluster {cluster.name!r} time-shares processors among its devices: pipelines "
            "of different depths are simulated on devices of their own; use one depth"
        )
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and cluster.node_of(rank) == cluster.node_of(runs[-1][-1]):
            runs[-1].append(rank)
        else:
            runs.append([rank])
    groups = tuple(
        NodeGroup(
            device=cluster.device(run[0]),
            devices_per_node=len(run),
            intra_node=_intra(cluster, run[0]),
            sharing_efficiency=cluster.sharing_efficiency(run[0]),
        )
        for run in runs
    )
    return Cluster(name=f"{cluster.name}[{ranks[0]}:{ranks[-1] + 1}]", groups=groups,
                   inter_node=cluster.inter_node)  # fmt: skip


def _intra(cluster: Cluster, rank: int) -> Link:
    first = 0
    for group in cluster.groups:
        if rank < first + group.num_devices:
            return group.intra_node
        first += group.num_devices
    raise ValueError(f"rank {rank} is outside cluster {cluster.name!r}")


def reduce_times(
    blocks: Sequence[BlockCost], layout: PipelineLayout, pipeline: int, cluster: Cluster,
    plan: SimPlan,
) -> list[float]:  # fmt: skip
    """Seconds of each stage's gradient reduction in `pipeline` of `layout`: per group of
    its blocks held alike, an all-reduce over their holders (one rank a pipeline)."""
    group_of = {b: ranks for ranks, held in layout.block_groups().items() for b in held}
    degree, out, first = len(layout.ranks), [], 0
    for size in layout.sizes[pipeline]:
        by_group: dict[tuple[int, ...], list[BlockCost]] = {}
        for b in range(first, first + size):
            by_group.setdefault(group_of[b], []).append(blocks[b])
        total = 0.0
        for ranks, held in by_group.items():
            links = AxisLinks({"dp": degree}, {"dp": cluster.group_link(ranks)})
            total += stage_sync_time(
                plan.compress, sum(b.num_params for b in held),
                sum(b.expert_params for b in held), layout=plan, links=links,
                device=cluster.device(ranks[pipeline]), param_bytes=dtype_bytes(plan.dtype),
            )  # fmt: skip
        out.append(total)
        first += size
    return out


class _Own(_Replica):
    """A replica whose stage reductions cost what the plan's pipelines make them cost."""

    def __init__(
        self, schedule: Schedule, stages: Sequence[StageCost], cluster: Cluster, plan: SimPlan,
        reduce_s: Sequence[float],
    ) -> None:  # fmt: skip
        self._reduce_s = list(reduce_s)
        super().__init__(schedule, stages, cluster, plan, 0)

    def dp_sync_time(self, stage: int) -> float:
        return self._reduce_s[stage]


def simulate_pipeline(
    schedule: Schedule, stages: Sequence[StageCost], cluster: Cluster, plan: SimPlan,
    ranks: Sequence[int], reduce_s: Sequence[float],
) -> ReplicaRun:  # fmt: skip
    """Replay one pipeline (`plan`: pp = its depth, dp = 1) on global `ranks` of `cluster`,
    its stage `s` reducing for `reduce_s[s]` seconds."""
    if plan.dp != 1 or plan.pp != len(ranks) or len(reduce_s) != len(stages):
        raise ValueError(
            f"a pipeline of {len(ranks)} ranks and {len(stages)} stages is replayed as dp=1, "
            f"pp={len(ranks)} with a reduction time per stage (got dp={plan.dp}, pp={plan.pp}, "
            f"{len(reduce_s)} times)"
        )
    return _Own(schedule, stages, own_cluster(cluster, ranks), plan, reduce_s).run()
