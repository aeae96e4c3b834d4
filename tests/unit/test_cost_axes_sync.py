"""Gradient sync and model state read the layout and name their axis: dense gradients are
reduced over axis "dp", expert gradients over axis "edp" (the dp·tp / ep ranks holding the
same experts), each at the degree and link `AxisLinks` gives that axis. Every expected
value is written out from the alpha-beta formulas (Thakur et al. 2005), not taken from
`plait.cost.comm`."""

from __future__ import annotations

import math
from typing import Any

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.config import ParallelPlan
from plait.cost import (
    AxisLinks,
    DataDegrees,
    StageCost,
    expert_dp_degree,
    expert_state_bytes,
    moe_optimizer_step_time,
    stage_sync_time,
    sync_degrees,
    weight_gather_time,
)
from plait.cost.compress import gradient_sync_time
from plait.profile import MoESpec
from plait.sim import SimPlan, build_schedule, simulate

DP_LINK = Link(latency_s=1e-5, bandwidth_Bps=1e10)
EDP_LINK = Link(latency_s=3e-4, bandwidth_Bps=2e8)
WRONG = Link(latency_s=7e-2, bandwidth_Bps=1e6)
N, X = 10_000_000, 4_000_000  # a stage's parameters, of which its experts'


def _ring_pass(n: int, num_bytes: float, link: Link) -> float:
    """One ring reduce-scatter or all-gather: (n-1)/n · B/beta + (n-1) · alpha."""
    if n == 1:
        return 0.0
    return (n - 1) / n * num_bytes / link.bandwidth_Bps + (n - 1) * link.latency_s


def _all_reduce(n: int, num_bytes: float, link: Link) -> float:
    """The faster of ring (2(n-1)/n · B/beta + 2(n-1) · alpha) and binary tree
    (2⌈log2 n⌉ · alpha + 2 · B/beta)."""
    if n == 1:
        return 0.0
    ring = 2 * (n - 1) / n * num_bytes / link.bandwidth_Bps + 2 * (n - 1) * link.latency_s
    tree = 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * num_bytes / link.bandwidth_Bps
    return min(ring, tree)


def _links(layout: DataDegrees, dp: Link = DP_LINK, edp: Link = EDP_LINK) -> AxisLinks:
    return AxisLinks(sync_degrees(layout), {"dp": dp, "edp": edp})


def test_the_expert_data_parallel_group_is_dp_tp_over_ep_for_every_layout() -> None:
    for dp, tp, ep in ((4, 1, 2), (2, 2, 2), (4, 2, 4), (2, 2, 4), (3, 2, 1)):
        degrees = DataDegrees(dp=dp, tp=tp, ep=ep)
        assert expert_dp_degree(degrees) == dp * tp // ep
        expected = {"dp": dp, "dp_replicate": dp, "dp_shard": 1, "edp": dp * tp // ep}
        assert sync_degrees(degrees) == expected
        # the plans satisfy the layout protocol as they are, and agree with the mesh's edp
        plan = ParallelPlan(dp=dp, tp=tp, ep=ep, pp=1)
        assert expert_dp_degree(plan) == plan.edp == dp * tp // ep
        assert expert_dp_degree(SimPlan(dp=dp, tp=tp, ep=ep)) == dp * tp // ep


def test_dense_gradients_reduce_over_the_dp_axis() -> None:
    layout = DataDegrees(dp=4, tp=2, ep=2)  # edp = 4, but there are no experts here
    got = _sync(N, 0, layout=layout, links=_links(layout), param_bytes=2)
    assert got == pytest.approx(_all_reduce(4, 2 * N, DP_LINK), rel=1e-12)
    # ZeRO-1/2: reduce-scatter plus the all-gather of the updated weights, ZeRO-3 only the first
    for zero, passes in ((1, 2), (2, 2), (3, 1)):
        z = DataDegrees(dp=4, tp=2, ep=2, zero=zero)
        got = _sync(N, 0, layout=z, links=_links(z), param_bytes=2)
        assert got == pytest.approx(passes * _ring_pass(4, 2 * N, DP_LINK), rel=1e-12)


@pytest.mark.parametrize(("dp", "tp", "ep"), [(4, 1, 2), (2, 2, 2), (4, 2, 2), (2, 4, 2)])
def test_expert_gradients_reduce_over_dp_tp_over_ep_ranks_on_the_edp_link(
    dp: int, tp: int, ep: int
) -> None:
    layout = DataDegrees(dp=dp, tp=tp, ep=ep, zero=1)
    edp = dp * tp // ep
    got = _sync(N, X, layout=layout, links=_links(layout), param_bytes=2)
    dense = 2 * _ring_pass(dp, 2 * (N - X), DP_LINK)
    experts = 2 * _ring_pass(edp, 2 * X, EDP_LINK)
    assert got == pytest.approx(dense + experts, rel=1e-12)
    # what dp alone would give (the experts over dp ranks) is not what is charged
    assert abs(got - 2 * _ring_pass(dp, 2 * N, DP_LINK)) > 1e-3 * got


def test_one_copy_of_each_expert_per_stage_leaves_nothing_to_reduce() -> None:
    layout = DataDegrees(dp=2, tp=2, ep=4)  # ep = dp·tp: every expert on one rank
    links = _links(layout)
    assert _sync(X, X, layout=layout, links=links, param_bytes=2) == 0.0
    got = _sync(N, X, layout=layout, links=links, param_bytes=2)
    assert got == pytest.approx(_all_reduce(2, 2 * (N - X), DP_LINK), rel=1e-12)
    compressed = gradient_sync_time(
        "bf16", X, zero_stage=0, links=links, axis="edp", device=_device(), param_bytes=4
    )
    assert compressed == 0.0


def test_a_wrong_link_on_one_axis_changes_only_that_axis_s_part() -> None:
    layout = DataDegrees(dp=4, tp=2, ep=2, zero=0)
    right = _sync(N, X, layout=layout, links=_links(layout), param_bytes=4)
    dense, experts = _all_reduce(4, 4 * (N - X), DP_LINK), _all_reduce(4, 4 * X, EDP_LINK)
    assert right == pytest.approx(dense + experts, rel=1e-12)
    bad_edp = _sync(N, X, layout=layout, links=_links(layout, edp=WRONG), param_bytes=4)
    assert bad_edp == pytest.approx(dense + _all_reduce(4, 4 * X, WRONG), rel=1e-12)
    bad_dp = _sync(N, X, layout=layout, links=_links(layout, dp=WRONG), param_bytes=4)
    assert bad_dp == pytest.approx(_all_reduce(4, 4 * (N - X), WRONG) + experts, rel=1e-12)


def _sync(num_params: float, expert_params: float, **kw: Any) -> float:
    """A stage's uncompressed gradient reduction (the device only prices codecs)."""
    return stage_sync_time("none", num_params, expert_params, device=_device(), **kw)


def _device() -> Device:
    return Device(name="d", peak_flops={"fp32": 1e12}, memory_bytes=2**34,
                  memory_bandwidth_Bps=1e11)  # fmt: skip


def test_compressed_sync_names_its_axis_too() -> None:
    """sign over the edp group of 4: an all-gather of every rank's N/8 bytes of signs and a
    4-byte scale, and eight passes over the N fp32 entries at memory bandwidth; the dp link
    plays no part, and ZeRO-1 adds the all-gather of the updated weights."""
    layout = DataDegrees(dp=8, tp=1, ep=2)
    n = 4
    wire = _ring_pass(n, n * (math.ceil(X / 8) + 4), EDP_LINK)
    codec = 8 * X * 4 / 1e11
    for dp_link in (DP_LINK, WRONG):
        links = _links(layout, dp=dp_link)
        got = gradient_sync_time(
            "sign", X, zero_stage=0, links=links, axis="edp", device=_device(), param_bytes=4
        )
        assert got == pytest.approx(wire + codec, rel=1e-12)
    zero1 = gradient_sync_time(
        "sign", X, zero_stage=1, links=_links(layout), axis="edp", device=_device(), param_bytes=4
    )
    assert zero1 == pytest.approx(wire + codec + _ring_pass(n, 4 * X, EDP_LINK), rel=1e-12)
    # ZeRO-2: a reduce-scatter and an all-gather in the two-byte dtype, over dp by default
    dense = gradient_sync_time(
        "bf16", N, zero_stage=2, links=_links(layout), device=_device(), param_bytes=4
    )
    assert dense == pytest.approx(2 * _ring_pass(8, 2 * N, DP_LINK), rel=1e-12)


def test_model_state_reads_the_layout() -> None:
    """Mixed-precision Adam, 2 + 2 + 12 bytes a parameter (Rajbhandari et al. 2020): ZeRO
    shards the dense part over dp and the experts over dp·tp / ep."""
    plan = SimPlan(dp=4, tp=2, ep=4, zero=1)  # edp = 2
    state = expert_state_bytes(N, X, layout=plan, dtype="bf16")
    assert (state.params, state.grads) == (2 * N, 2 * N)
    assert state.optimizer == pytest.approx(12 * (N - X) / 4 + 12 * X / 2, rel=1e-12)
    z3 = expert_state_bytes(N, X, layout=DataDegrees(dp=4, tp=2, ep=4, zero=3), dtype="bf16")
    assert z3.total == pytest.approx(16 * (N - X) / 4 + 16 * X / 2, rel=1e-12)
    device = Device(name="d", peak_flops={"fp32": 1e12}, memory_bytes=2**34,
                    memory_bandwidth_Bps=1e12)  # fmt: skip
    # the step reads gradient and state and writes state and parameter: 2 + 2 + 2·12 bytes
    step = moe_optimizer_step_time(N, X, device, layout=plan, dtype="bf16")
    assert step == pytest.approx(28 * ((N - X) / 4 + X / 2) / 1e12, rel=1e-12)


def test_zero3_gathers_dense_weights_over_dp_and_experts_over_edp() -> None:
    layout = DataDegrees(dp=4, tp=1, ep=2, zero=3)
    got = weight_gather_time(N, X, layout=layout, links=_links(layout), param_bytes=2)
    expected = _ring_pass(4, 2 * (N - X), DP_LINK) + _ring_pass(2, 2 * X, EDP_LINK)
    assert got == pytest.approx(expected, rel=1e-12)
    below = DataDegrees(dp=4, tp=1, ep=2, zero=2)
    assert weight_gather_time(N, X, layout=below, links=_links(below), param_bytes=2) == 0.0


def test_the_simulator_reduces_experts_over_dp_tp_over_ep_ranks() -> None:
    """dp = tp = ep = 2 on one uniform link, one stage, ZeRO-1: the dense gradients over
    the 2 dp ranks and the experts over dp·tp/ep = 2 ranks (dp/ep would be 1: nothing)."""
    link = Link(latency_s=1e-3, bandwidth_Bps=1e8)
    device = Device(name="toy", peak_flops={"bf16": 1e12}, efficiency=1.0,
                    memory_bytes=80 * 2**30, memory_bandwidth_Bps=1e12)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=4, intra_node=link, num_nodes=1)
    cluster = Cluster(name="flat", groups=(group,), inter_node=link)
    spec = MoESpec(num_layers=2, hidden=64, num_heads=4, seq_len=32, vocab_size=96,
                   num_experts=4, top_k=2, moe_every=1)  # fmt: skip
    plan = SimPlan(dp=2, tp=2, ep=2, microbatches=1, dtype="bf16", seq_len=32, zero=1)
    stage = StageCost(tuple(spec.block_costs(dtype="bf16", layout=plan)))
    assert stage.expert_params > 0
    result = simulate(build_schedule(plan), [stage], cluster, plan)
    rest, experts = stage.num_params - stage.expert_params, stage.expert_params
    expected = 2 * _ring_pass(2, 2 * rest, link) + 2 * _ring_pass(2, 2 * experts, link)
    assert result.ranks[0].dp_comm_s == pytest.approx(expected, rel=1e-12)


def test_a_layout_given_by_numbers_refuses_what_no_mesh_can_be() -> None:
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp × tp = 4"):
        DataDegrees(dp=2, tp=2, ep=3)
    with pytest.raises(ValueError, match=r"zero=4 must be 0, 1, 2 or 3"):
        DataDegrees(dp=2, zero=4)
    with pytest.raises(ValueError, match=r"dp=0 must be an integer >= 1"):
        DataDegrees(dp=0)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_codec_compresses_dense_gradients_only_below_zero_2(zero: int) -> None:
    """Under a codec (here PowerSGD, ZeRO-0/1) the runtime compresses the dp buckets and
    all-reduces the expert gradients uncompressed over their replicas: the experts' part
    is the plain reduction over "edp"; a rank without experts pays nothing on "edp"."""
    from plait.cost import stage_sync_time

    layout = DataDegrees(dp=4, tp=1, ep=2, zero=zero)
    device = Device(name="d", peak_flops={"fp32": 1e13}, memory_bytes=1 << 34,
                    memory_bandwidth_Bps=1e12)  # fmt: skip
    links = _links(layout)
    kw = {"layout": layout, "links": links, "device": device, "param_bytes": 4}
    with_experts = stage_sync_time("powersgd:2", N, X, **kw)  # type: ignore[arg-type]
    dense_only = stage_sync_time("powersgd:2", N - X, 0, **kw)  # type: ignore[arg-type]
    plain = _all_reduce(2, 4 * X, EDP_LINK) if zero == 0 else 2 * _ring_pass(2, 4 * X, EDP_LINK)
    assert with_experts - dense_only == pytest.approx(plain, rel=1e-9)
    # the dense part is priced on "dp" alone: a broken edp link does not move it
    broken = _links(layout, edp=WRONG)
    assert stage_sync_time("powersgd:2", N - X, 0, layout=layout, links=broken, device=device,
                           param_bytes=4) == dense_only  # fmt: skip
