"""Replicas with unequal shares of the batch: where the micro-batches do not divide equally
among the data-parallel replicas, the planner gives them shares differing by one, priced by
the replica with the most, and writes them as pipelines of their own, which training runs."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.plan import SearchSpace, describe, gpt_spec, search
from plait.plan.io import parallel_plan_of, plan_to_dict
from plait.sim import SimPlan

GIB = 2**30
_DEVICE = Device(name="gpu", peak_flops={"bf16": 100e12}, efficiency=0.5, memory_bytes=80 * GIB)
_FAST = Link(latency_s=1e-6, bandwidth_Bps=100e9)
CLUSTER = Cluster(
    name="three",
    groups=(NodeGroup(device=_DEVICE, devices_per_node=3, intra_node=_FAST, num_nodes=1),),
    inter_node=_FAST,
)
MODEL = gpt_spec(num_layers=3, hidden=512, num_heads=8, seq_len=64, vocab_size=1000)
SPACE = SearchSpace(schedules=("1f1b", "gpipe"), recompute=("none",), zero_stages=(0,),
                    micro_batch_sizes=(1,), sequence_parallel=(False,))  # fmt: skip


def test_eight_samples_on_three_replicas_load_three_at_most() -> None:
    rate = 100.0  # samples/s per loader: slow enough that every plan waits for input
    found = search(MODEL, CLUSTER, global_batch=8, space=SPACE, loader_samples_per_s=rate)
    best = found.best.plan
    assert (best.dp, best.pp) == (3, 1), describe(best)
    assert best.shares == (3, 3, 2) and best.global_batch_size == 8
    assert found.best.step_time_s == pytest.approx(3 / rate, rel=1e-9)  # the largest share
    # equal shares only: the three devices are one pipeline, whose one loader reads all 8
    even = search(MODEL, CLUSTER, global_batch=8, loader_samples_per_s=rate,
                  space=dataclasses.replace(SPACE, uneven_shares=False))  # fmt: skip
    assert (even.best.plan.dp, even.best.plan.pp) == (1, 3)
    assert even.best.step_time_s == pytest.approx(8 / rate, rel=1e-9)
    assert "3/2 (8 in all)" in describe(best)


def test_the_largest_share_prices_the_step_as_equal_shares_of_it_would() -> None:
    """Shares (3, 3, 2) take as long as three replicas of 3: the slowest replica sets the
    step, and the gradient all-reduce is the same."""
    uneven = search(MODEL, CLUSTER, global_batch=8, space=SPACE, num_devices=3)
    nine = search(MODEL, CLUSTER, global_batch=9, space=SPACE, num_devices=3)

    def dp3(found: object, total: int) -> float:
        return next(r.step_time_s for r in found.ranked  # type: ignore[attr-defined]
                    if r.plan.dp == 3 and r.plan.total_microbatches == total)  # fmt: skip

    assert dp3(uneven, 8) == pytest.approx(dp3(nine, 0), rel=1e-9)


def test_the_plan_file_trains_as_pipelines_of_their_own_shares() -> None:
    found = search(MODEL, CLUSTER, global_batch=8, space=SPACE, loader_samples_per_s=100.0)
    data = plan_to_dict(found.best)
    assert data["global_batch"] == 8
    assert [p["microbatches"] for p in data["pipelines"]] == [3, 3, 2]
    assert all(p["partition"] == [MODEL.num_blocks] for p in data["pipelines"])
    plan = parallel_plan_of(data)
    assert plan.dp == 3 and plan.pipelines is not None
    assert [p.microbatches for p in plan.pipelines] == [3, 3, 2]


@pytest.mark.parametrize("total", [2, 6, 10])
def test_a_total_the_replicas_cannot_share_is_refused(total: int) -> None:
    with pytest.raises(ValueError, match=f"total_microbatches={total} cannot be shared"):
        SimPlan(dp=3, microbatches=3, total_microbatches=total)
