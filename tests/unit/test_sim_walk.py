"""The simulator's array read of each rank's times equals the event-by-event reference."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cost import BlockCost
from plait.presets import load_cluster
from plait.schedule import KINDS, schedule_kind
from plait.sim import SimPlan, build_schedule, simulate
from plait.sim import replica as sim_replica


def uneven_blocks(n: int) -> list[BlockCost]:
    """Stages of unequal forward, backward and weight-gradient work, memory and size."""
    return [
        BlockCost(
            name=f"b{i}",
            forward_flops=1e12 * (1 + 0.37 * i),
            backward_input_flops=1.3e12 * (1 + 0.11 * (n - i)),
            backward_weight_flops=0.9e12 * (1 + 0.23 * (i % 3)),
            saved_bytes=1e8 * (1 + i % 4),
            activation_bytes=3e7 * (1 + i % 2),
            num_params=int(1e7 * (1 + i)),
        )
        for i in range(n)
    ]


def plans() -> list[SimPlan]:
    out = []
    for kind in KINDS:
        entry = schedule_kind(kind)
        chunks = entry.exact_chunks or (2 if entry.chunked else 1)
        for p, m in [(2, 1), (2, 5), (3, 4), (4, 8)]:
            try:
                out.append(
                    SimPlan(dp=2, pp=p, microbatches=m, schedule=kind, chunks=chunks, zero=1)
                )
            except ValueError:  # a kind that does not run this shape
                continue
    return out


@pytest.mark.parametrize("plan", plans(), ids=lambda p: f"{p.schedule}-p{p.pp}-m{p.microbatches}")
def test_array_walk_equals_event_walk(plan: SimPlan, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = load_cluster("dgx-a100-80gb", num_nodes=2)
    try:
        schedule = build_schedule(plan)
    except ValueError:
        pytest.skip(f"{plan.schedule} does not build for p={plan.pp} m={plan.microbatches}")
    stages = uneven_blocks(schedule.num_parts if schedule.num_parts else schedule.num_stages)
    fast = simulate(schedule, stages, cluster, plan)
    monkeypatch.setattr(sim_replica, "REFERENCE_WALK", True)
    slow = simulate(schedule, stages, cluster, plan)
    assert fast.step_time_s == slow.step_time_s
    assert fast.pipeline_time_s == slow.pipeline_time_s
    assert fast.bubble_fraction == slow.bubble_fraction
    assert fast.comm_share == slow.comm_share
    for a, b in zip(fast.ranks, slow.ranks, strict=True):
        assert dataclasses.asdict(a) == dataclasses.asdict(b)
    assert fast.ranks[0].memory.activations > 0  # the peaks were read, not left at 0
