"""Posting pipeline messages in the simulator (`Device.message_s`): each forward and
backward pays one posting per boundary of its stage that crosses ranks, on the rank that
computes it. The expected times are closed forms written here, not the simulator's."""

from __future__ import annotations

import math
import tomllib

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost, StageCost
from plait.presets import cluster_from_toml, cluster_to_toml
from plait.sim import SimPlan, build_schedule, simulate

RATE = 1e12
FREE = Link(latency_s=0.0, bandwidth_Bps=math.inf)
F = 1e-3  # a stage's forward; its backward is twice that, split in equal halves


def _cluster(ranks: int, message_s: float) -> Cluster:
    device = Device(name="d", peak_flops={"fp32": RATE}, memory_bytes=1 << 40,
                    message_s=message_s)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=ranks, intra_node=FREE)
    return Cluster(name="host", groups=(group,), inter_node=FREE)


def _run(kind: str, pp: int, m: int, message_s: float, chunks: int = 1):  # type: ignore[no-untyped-def]
    block = BlockCost(name="b", forward_flops=F * RATE, backward_input_flops=F * RATE,
                      backward_weight_flops=F * RATE)  # fmt: skip
    plan = SimPlan(pp=pp, schedule=kind, microbatches=m, chunks=chunks, dtype="fp32",
                   optimizer="sgd")  # fmt: skip
    schedule = build_schedule(plan)
    stages = [StageCost((block,)) for _ in range(schedule.num_stages)]
    return simulate(schedule, stages, _cluster(pp, message_s), plan)


@pytest.mark.parametrize("m", [1, 4])
def test_two_stages_pay_one_posting_per_forward_and_backward(m: int) -> None:
    # GPipe over 2 equal stages, each forward and backward with one crossing boundary:
    # (m + 1) slots of forward then of backward, each q longer
    q = 2e-4
    step = _run("gpipe", 2, m, q).step_time_s
    assert step == pytest.approx((m + 1) * (F + q + 2 * F + q), rel=1e-9)
    assert _run("gpipe", 2, m, 0.0).step_time_s == pytest.approx((m + 1) * 3 * F, rel=1e-9)


def test_one_stage_posts_nothing() -> None:
    assert _run("gpipe", 1, 4, 5e-4).step_time_s == _run("gpipe", 1, 4, 0.0).step_time_s


@pytest.mark.parametrize(("kind", "per_microbatch"), [("zb-v", 4), ("interleaved", 6)])
def test_boundaries_within_a_rank_post_nothing(kind: str, per_microbatch: int) -> None:
    # 4 stages on 2 ranks. zb-v places them 0,1,1,0: the middle boundary stays on rank 1,
    # so each rank's two stages have one crossing boundary each, 2 postings a forward and
    # 2 a backward per micro-batch; interleaved places them 0,1,0,1: every boundary
    # crosses, 3 and 3
    q, m = 1e-4, 4
    posted, plain = _run(kind, 2, m, q, chunks=2), _run(kind, 2, m, 0.0, chunks=2)
    for a, b in zip(posted.ranks, plain.ranks, strict=True):
        assert a.compute_s - b.compute_s == pytest.approx(m * per_microbatch * q, rel=1e-9)


def test_message_s_is_checked_and_kept_by_cluster_files() -> None:
    with pytest.raises(ValueError, match=r"message_s=-1 must be a finite number of seconds"):
        Device(name="d", peak_flops={"fp32": 1.0}, memory_bytes=1, message_s=-1)
    text = cluster_to_toml(_cluster(2, 3e-4))
    assert "message_s = 3e-04" in text
    assert "message_s" not in cluster_to_toml(_cluster(2, 0.0))  # older files unchanged
    assert cluster_from_toml(tomllib.loads(text)).device(1).message_s == 3e-4
