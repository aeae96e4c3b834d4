"""Posting a pipeline message costs a rank compute time: on workers time-sharing cores,
a wait for the communication thread's slice (`Device.message_s`, measured by
`plait.profile.calibrate.message_s`). The simulator adds it to every forward and
backward (and a split backward's input half) of a stage, once per boundary it shares
with a stage on another rank: the expected compute times are counted out here from the
schedule's shape, not read from the simulator."""

from __future__ import annotations

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost, StageCost
from plait.sim import SimPlan, build_schedule, simulate

LINK = Link(latency_s=1e-5, bandwidth_Bps=1e10)
POST = 3e-4  # seconds a message's posting takes
F = 1e-3  # each stage's forward; each backward half as long again (1e9 FLOPs at 1e12)


def _cluster(ranks: int, message_s: float) -> Cluster:
    device = Device(name="d", peak_flops={"fp32": 1e12}, memory_bytes=1 << 36,
                    message_s=message_s)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=ranks, intra_node=LINK, num_nodes=1)
    return Cluster(name="flat", groups=(group,), inter_node=LINK)


def _stage() -> StageCost:
    return StageCost((BlockCost(name="b", forward_flops=1e9, backward_input_flops=1e9,
                                backward_weight_flops=1e9, activation_bytes=1e4,
                                saved_bytes=1e5, num_params=1000),))  # fmt: skip


def _compute(plan: SimPlan, message_s: float) -> list[float]:
    result = simulate(build_schedule(plan), [_stage()] * plan.pp * plan.chunks,
                      _cluster(plan.pp, message_s), plan)  # fmt: skip
    return [r.compute_s for r in result.ranks]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_each_stage_pays_a_posting_per_crossing_boundary_in_forward_and_backward(
    schedule: str,
) -> None:
    m, pp = 4, 3
    plan = SimPlan(pp=pp, microbatches=m, schedule=schedule, dtype="fp32")
    plain, posted = _compute(plan, 0.0), _compute(plan, POST)
    # stages 0 and 2 share one boundary, stage 1 two; per micro-batch a forward and a
    # backward (zb-h1: the input half posts, the weight half does not)
    crossings = [1, 2, 1]
    for rank in range(pp):
        assert posted[rank] - plain[rank] == pytest.approx(2 * m * crossings[rank] * POST,
                                                           rel=1e-9)  # fmt: skip


def test_stages_on_one_rank_post_nothing_between_them() -> None:
    # ZB-V: each rank holds two stages, and stages 1 and 2 (the V's turn) share rank 1
    m = 4
    plan = SimPlan(pp=2, microbatches=m, schedule="zb-v", chunks=2, dtype="fp32")
    plain, posted = _compute(plan, 0.0), _compute(plan, POST)
    # rank 0 holds stages 0 and 3 (each one crossing), rank 1 stages 1 and 2 (one each)
    for rank in range(2):
        assert posted[rank] - plain[rank] == pytest.approx(2 * m * 2 * POST, rel=1e-9)


def test_a_negative_or_infinite_posting_time_is_refused_naming_it() -> None:
    for bad in (-1e-3, float("inf")):
        with pytest.raises(ValueError, match="message_s="):
            _cluster(2, bad)
