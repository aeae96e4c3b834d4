"""A collective runs over the group of its axis: tensor parallel by default, the token
all-to-all of experts over the ep group."""

from __future__ import annotations

import pytest

from plait.cluster import Device, Link
from plait.cost import AxisLinks, Collective, StageCost, collective_time
from plait.cost.blocks import BlockCost


def test_a_collective_runs_over_the_group_of_its_axis() -> None:
    fast, slow = Link(latency_s=1e-6, bandwidth_Bps=1e11), Link(latency_s=1e-5, bandwidth_Bps=1e9)
    tp_c = Collective(kind="all_reduce", num_bytes=1e6, axis="tp")
    ep_c = Collective(kind="all_to_all", num_bytes=2e6, axis="ep")
    links = AxisLinks({"tp": 2, "ep": 4}, {"tp": fast, "ep": slow})
    expected = collective_time(tp_c, 2, fast) + collective_time(ep_c, 4, slow)
    assert links.time([tp_c, ep_c]) == pytest.approx(expected, rel=1e-12)
    assert AxisLinks({"tp": 2}, {"tp": fast}).time([ep_c]) == 0.0  # ep of one rank
    block = BlockCost(
        name="b", forward_flops=1e9, backward_input_flops=1e9, forward_comm=(tp_c, ep_c)
    )
    device = Device(name="d", peak_flops={"fp32": 1e12}, memory_bytes=10**9)
    times = StageCost((block,)).times(device, "fp32", links=links)
    assert times.comm_forward_s == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="collective axis 'sp' is unknown"):
        Collective(kind="all_reduce", num_bytes=1.0, axis="sp")
