"""The cost model knows hybrid sharding (HSDP): gradients are reduce-scattered over
dp_shard and each shard all-reduced over dp_replicate, weights gathered over dp_shard,
state sharded over dp_shard only. Expected values are written out from the alpha-beta
formulas (Thakur et al. 2005), not taken from `plait.cost.comm`."""

from __future__ import annotations

import math

import pytest

from plait.cluster import Device, Link
from plait.config import ParallelPlan
from plait.cost import (
    AxisLinks,
    expert_state_bytes,
    shard_degree,
    stage_sync_time,
    sync_degrees,
    weight_gather_time,
)
from plait.cost.comm import dp_sync_collectives

SHARD = Link(latency_s=1e-6, bandwidth_Bps=1e11)  # inside a node
REPLICATE = Link(latency_s=1e-5, bandwidth_Bps=1e9)  # across nodes
N = 10_000_000
DEVICE = Device(name="d", peak_flops={"fp32": 1e12}, memory_bytes=10**10)


def _ring_pass(n: int, num_bytes: float, link: Link) -> float:
    return (n - 1) / n * num_bytes / link.bandwidth_Bps + (n - 1) * link.latency_s


def _all_reduce(n: int, num_bytes: float, link: Link) -> float:
    ring = 2 * (n - 1) / n * num_bytes / link.bandwidth_Bps + 2 * (n - 1) * link.latency_s
    tree = 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * num_bytes / link.bandwidth_Bps
    return min(ring, tree)


def _links(plan: ParallelPlan) -> AxisLinks:
    return AxisLinks(
        sync_degrees(plan), {"dp": REPLICATE, "dp_shard": SHARD, "dp_replicate": REPLICATE}
    )


def test_hsdp_reduces_inside_then_across_and_gathers_inside() -> None:
    plan = ParallelPlan(dp_replicate=2, dp_shard=4, pp=1)
    links, size = _links(plan), N * 4
    expected = _ring_pass(4, size, SHARD) + _all_reduce(2, size / 4, REPLICATE)
    got = stage_sync_time("none", N, 0, layout=plan, links=links, device=DEVICE, param_bytes=4)
    assert got == pytest.approx(expected, rel=1e-12)
    gather = weight_gather_time(N, 0, layout=plan, links=links, param_bytes=4)
    assert gather == pytest.approx(_ring_pass(4, size, SHARD), rel=1e-12)
    kinds = [(c.kind, c.axis) for c in dp_sync_collectives(size, zero_stage=2, hybrid_shard=4)]
    assert kinds == [
        ("reduce_scatter", "dp_shard"),
        ("all_reduce", "dp_replicate"),
        ("all_gather", "dp_shard"),
    ]


def test_hsdp_shards_state_over_dp_shard_only() -> None:
    hsdp = ParallelPlan(dp_replicate=2, dp_shard=4, pp=1)
    fsdp = ParallelPlan(dp=8, zero=3, pp=1)
    assert shard_degree(hsdp) == 4 and shard_degree(fsdp) == 8
    state = expert_state_bytes(N, 0, layout=hsdp, dtype="fp32")
    # fp32 Adam: 4 B weights + 4 B grads + 8 B moments (plus none kept apart), all / 4
    whole = expert_state_bytes(N, 0, layout=ParallelPlan(dp=1, pp=1), dtype="fp32")
    assert state.params == whole.params / 4 and state.optimizer == whole.optimizer / 4
    assert state.grads == whole.grads / 4


def test_plain_zero3_keeps_its_one_axis() -> None:
    plan = ParallelPlan(dp=8, zero=3, pp=1)
    links, size = _links(plan), N * 4
    got = stage_sync_time("none", N, 0, layout=plan, links=links, device=DEVICE, param_bytes=4)
    assert got == pytest.approx(_ring_pass(8, size, REPLICATE), rel=1e-12)
