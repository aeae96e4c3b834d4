"""Which processors a replica's ranks compute on, and who else loads them: the
`plait.schedule.sharing.Sharing` a replay of one data-parallel replica runs under when the
cluster's devices time-share processors (CPU workers outnumbering their cores)."""

from __future__ import annotations

from plait.cluster import Cluster
from plait.schedule.sharing import Sharing
from plait.sim.plan import SimPlan

__all__ = ["replica_sharing"]


def replica_sharing(cluster: Cluster, plan: SimPlan, dp_rank: int) -> Sharing:
    """Processors of the replica's ranks, each loaded by every process that computes in
    step with a replica rank: that rank's copies in every replica and its tensor peers
    (replicas are assumed to run alike, which they do on identical devices)."""
    processors = [cluster.processor(plan.global_rank(r, dp_rank)) for r in range(plan.pp)]
    ids = sorted(set(processors))
    load = [[0] * plan.pp for _ in ids]
    for r in range(plan.pp):
        for d in range(plan.dp):
            for t in range(plan.tp):
                p = cluster.processor(plan.global_rank(r, d, t))
                if p in ids:
                    load[ids.index(p)][r] += 1
    ranks = [plan.global_rank(r, dp_rank) for r in range(plan.pp)]
    efficiency = min(cluster.sharing_efficiency(g) for g in ranks)
    return Sharing(tuple(ids.index(p) for p in processors), tuple(map(tuple, load)), efficiency)
