"""Chimera holds a replica of each model part on two pipeline ranks, and the runtime sums
their gradients before each update (`plait.parallel.replicas`); the simulator charges it:
each part's gradient copied into a buffer, all-reduced over the 2 ranks holding it and
copied back. The expected times are written out from the alpha-beta formula of a
2-rank all-reduce (B/beta + 2·alpha) and one pass per copy at memory bandwidth."""

from __future__ import annotations

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost, StageCost
from plait.sim import SimPlan, build_schedule, simulate

LINK = Link(latency_s=2e-4, bandwidth_Bps=1e8)
MEMORY_BPS = 5e10
PARAMS = (3_000_000, 5_000_000)  # parts 0 and 1


def _cluster(ranks: int) -> Cluster:
    device = Device(name="d", peak_flops={"fp32": 1e12}, efficiency=1.0,
                    memory_bytes=1 << 36, memory_bandwidth_Bps=MEMORY_BPS)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=ranks, intra_node=LINK, num_nodes=1)
    return Cluster(name="flat", groups=(group,), inter_node=LINK)


def _part(k: int) -> StageCost:
    block = BlockCost(name=f"part{k}", forward_flops=1e9, backward_input_flops=1e9,
                      backward_weight_flops=1e9, activation_bytes=1e5, saved_bytes=1e6,
                      num_params=PARAMS[k])  # fmt: skip
    return StageCost((block,))


def _optimizer_s(schedule: str) -> list[float]:
    plan = SimPlan(pp=2, microbatches=4, schedule=schedule, dtype="fp32")
    result = simulate(build_schedule(plan), [_part(0), _part(1)], _cluster(2), plan)
    return [r.optimizer_s for r in result.ranks]


def test_each_rank_sums_the_gradients_of_the_parts_it_shares_before_updating() -> None:
    # 1F1B: rank k updates part k alone, so these are the plain optimizer steps
    plain = _optimizer_s("1f1b")
    chimera = _optimizer_s("chimera")
    summed = 0.0
    for params in PARAMS:
        grads = 4.0 * params  # fp32
        summed += grads / LINK.bandwidth_Bps + 2 * LINK.latency_s + 2 * grads / MEMORY_BPS
    # each Chimera rank holds a replica of both parts: both steps, both sums
    for rank in range(2):
        assert chimera[rank] == pytest.approx(sum(plain) + summed, rel=1e-9)
