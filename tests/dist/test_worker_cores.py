"""Workers pinned to a core each still plan for the host's cores: the planner's local
cluster shares processors only where workers outnumber the cores they were started on.
(A pinned worker's own affinity is one core; planning from it modelled two workers on two
cores, or four, as time-sharing a single core.)"""

from __future__ import annotations

import os

import pytest

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU pinning is Linux's"),
]


def _seen(world: int) -> tuple[int, int, int | None, bool]:
    from plait.cluster import local_cpu
    from plait.mesh import host_cores, init_worker
    from plait.train.planinputs import local_cluster

    init_worker(device="cpu")
    cluster = local_cluster(world, local_cpu(devices=1).groups[0].intra_node)
    group = cluster.groups[0]
    return len(os.sched_getaffinity(0)), host_cores(), group.processors, cluster.shares_processors


@pytest.mark.parametrize("world", [2, 4])
def test_pinned_workers_plan_for_the_cores_they_were_started_on(world: int) -> None:
    from plait.train import launch

    cores = len(os.sched_getaffinity(0))  # what the workers are started on
    if cores < 2:
        pytest.skip("needs two cores to pin two workers apart")
    seen = launch(_seen, world, world)
    for own, host, processors, shared in seen.values():
        assert own == max(1, cores // world)  # pinned to its share
        assert host == cores
        assert shared == (world > cores)
        if shared:
            assert processors == cores
