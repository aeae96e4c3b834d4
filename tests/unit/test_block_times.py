"""`block_times` prices each kind of block once: its times are, block by block, what each
block priced alone gives, names aside (a model's layers differ only in their names)."""

from __future__ import annotations

import pytest

from plait.cost import AxisLinks, StageCost, block_times
from plait.plan import gpt_spec
from plait.presets import load_cluster
from plait.sim import SimPlan


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_block_times_are_each_block_priced_alone(recompute: str) -> None:
    cluster = load_cluster("dgx-a100-80gb", num_nodes=1)
    blocks = gpt_spec(num_layers=6, hidden=1024, num_heads=16, seq_len=512,
                      vocab_size=50304).blocks_for(SimPlan(tp=2))  # fmt: skip
    device = cluster.device(0)
    links = AxisLinks({"tp": 2}, {"tp": cluster.group_link([0, 1])})
    found = block_times(blocks, device, "bf16", recompute=recompute, links=links)  # type: ignore[arg-type]
    alone = [StageCost((b,)).times(device, "bf16", recompute=recompute, links=links)  # type: ignore[arg-type]
             for b in blocks]  # fmt: skip
    assert found == alone
    assert len({b.name for b in blocks}) == len(blocks)  # every block has its own name
