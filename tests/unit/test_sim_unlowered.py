"""A schedule replayed before its sends and receives are inserted takes the lowered
schedule's times: every action, every send, every memory peak and every prediction.

The reference is the lowered schedule (`add_communication`'s explicit sends and receives)
replayed by the same interpreter's other path; the planner simulates the unlowered form.
"""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost, StageCost, transformer_block_costs
from plait.presets import load_cluster
from plait.schedule import KINDS, Action, Op, Replay, build, replay, unroll
from plait.schedule.sharing import Sharing
from plait.sim import SimPlan, build_schedule, simulate

_RECEIVES = (Op.RECV_F, Op.RECV_B)


def _events(result: Replay) -> list[list[tuple[str, float, float]]]:
    """Per rank, every event but the receives (which only post), in program order."""
    return [
        [(str(e.action), e.start, e.end) for e in row if e.action.op not in _RECEIVES]
        for row in result.events
    ]


def _costs(seed: str) -> tuple[object, object]:
    """Random durations and transfers, the same for an action in either form."""
    rng = random.Random(seed)
    costs: dict[object, float] = {}

    def duration(rank: int, action: Action) -> float:
        return costs.setdefault((rank, str(action)), rng.uniform(0.5, 2.0))

    def transfer(rank: int, action: Action) -> float:  # up to 1.5: channels queue
        return costs.setdefault(("send", rank, str(action)), rng.uniform(0.0, 1.5))

    return duration, transfer


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("p", "m"), [(2, 3), (3, 6), (4, 8)])
def test_every_kind_replays_to_the_lowered_times(kind: str, p: int, m: int) -> None:
    chunks = KINDS[kind].default_chunks
    lowered = build(kind, p, m, chunks, check=False)
    bare = build(kind, p, m, chunks, check=False, lowered=False)
    assert not any(a.op in (*_RECEIVES, Op.SEND_F, Op.SEND_B) for r in bare.ranks for a in r)
    windows = 1 if lowered.policy == "sync" and lowered.reach == 0 else lowered.reach + 3
    duration, transfer = _costs(f"{kind}{p}{m}")
    for sharing in (None, Sharing.of([r // 2 for r in range(p)])):  # two ranks a processor
        options = {"duration": duration, "transfer": transfer, "sharing": sharing}
        a = replay(unroll(lowered, windows).schedule, **options)  # type: ignore[arg-type]
        b = replay(unroll(bare, windows).schedule, **options)  # type: ignore[arg-type]
        assert a.completed and b.completed
        assert _events(b) == _events(a)
        assert b.peak_inflight == a.peak_inflight


def _gpt_blocks() -> list[BlockCost]:
    return transformer_block_costs(
        num_layers=8,
        hidden=1024,
        num_heads=16,
        seq_len=512,
        vocab_size=32000,
        micro_batch_size=2,
        layout=SimPlan(tp=2),
    )


def _shared_cluster() -> Cluster:
    group = NodeGroup(
        device=Device(name="cpu", peak_flops={"fp32": 1e11, "bf16": 2e11}, memory_bytes=1 << 40),
        devices_per_node=16,
        intra_node=Link(latency_s=1e-4, bandwidth_Bps=5e8),
        processors=8,
        sharing_efficiency=0.8,
    )
    return Cluster(name="shared", groups=(group,), inter_node=group.intra_node)


@pytest.mark.parametrize(
    ("kind", "chunks", "cluster"),
    [
        ("gpipe", 1, "dgx-a100-80gb"),
        ("1f1b", 1, "dgx-a100-80gb"),
        ("interleaved", 2, "dgx-a100-80gb"),
        ("zb-h1", 1, "dgx-a100-80gb"),
        ("zb-v", 2, "dgx-a100-80gb"),
        ("chimera", 1, "dgx-a100-80gb"),
        ("pipedream", 1, "dgx-a100-80gb"),
        ("1f1b", 1, "shared"),
        ("2bw", 1, "shared"),
    ],
)
def test_the_simulator_predicts_the_same_step_from_either_form(
    kind: str, chunks: int, cluster: str
) -> None:
    machines = _shared_cluster() if cluster == "shared" else load_cluster(cluster, 2)
    plan = SimPlan(dp=2, tp=2, pp=4, microbatches=8, schedule=kind, chunks=chunks,
                   dtype="bf16", zero=1)  # fmt: skip
    blocks = _gpt_blocks()
    k = plan.pp * chunks
    cuts = [round(i * len(blocks) / k) for i in range(k + 1)]
    costs = [StageCost(tuple(blocks[a:b])) for a, b in pairwise(cuts)]
    lowered = simulate(build_schedule(plan), costs, machines, plan)
    bare = simulate(build_schedule(plan, check=False, lowered=False), costs, machines, plan)
    assert bare.step_time_s == lowered.step_time_s > 0
    assert bare.pipeline_time_s == lowered.pipeline_time_s
    assert bare.bubble_fraction == lowered.bubble_fraction
    assert bare.comm_share == lowered.comm_share and lowered.comm_share > 0
    assert bare.ranks == lowered.ranks  # p2p, reductions, updates, memory: every figure
    assert bare.timeline == lowered.timeline  # sends included, receives never shown
