"""Ranks time-sharing processors: the replay, the cluster's processors, the simulator, pinning."""

from __future__ import annotations

import random

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost
from plait.mesh import cpu_cores_for
from plait.schedule import KINDS, Op, build, replay
from plait.schedule.sharing import Sharing, fit_efficiency
from plait.sim import SimPlan, build_schedule, simulate

FREE = Link(latency_s=0.0, bandwidth_Bps=1e30)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 3), (3, 6), (4, 8)])
def test_own_processors_replay_exactly_as_replay(kind: str, p: int, m: int) -> None:
    schedule = build(kind, p, m, KINDS[kind].default_chunks)
    rng = random.Random(f"{kind}{p}{m}")
    costs: dict[object, float] = {}

    def duration(rank: int, action: object) -> float:
        return costs.setdefault((rank, action), rng.uniform(0.5, 2.0))

    def transfer(rank: int, action: object) -> float:
        return costs.setdefault(("send", rank, action), rng.uniform(0.0, 0.5))

    expected = replay(schedule, duration=duration, transfer=transfer)
    got = replay(schedule, duration=duration, transfer=transfer, sharing=Sharing.of(range(p)))
    assert got.completed and got.peak_inflight == expected.peak_inflight
    for mine, theirs in zip(got.events, expected.events, strict=True):
        assert [e.action for e in mine] == [e.action for e in theirs]
        assert [e.start for e in mine] == pytest.approx([e.start for e in theirs], abs=1e-9)
        assert [e.end for e in mine] == pytest.approx([e.end for e in theirs], abs=1e-9)


Spans = list[list[tuple[str, float, float]]]


def compute_spans(kind: str, p: int, m: int, sharing: Sharing) -> Spans:
    result = replay(build(kind, p, m), sharing=sharing)
    return [
        [(str(e.action), e.start, e.end) for e in row if e.action.op in (Op.F, Op.B)]
        for row in result.events
    ]


def test_two_ranks_on_one_processor_share_it_while_both_compute() -> None:
    rows = compute_spans("gpipe", 2, 2, Sharing.of([0, 0]))
    # 0F0 runs alone; 0F1 and 1F0 share (2 s for 1 s of work each); 1F1 alone; 1B1
    # waits for nothing, 1B0 shares with 0B0 ...; the processor never idles: 12 s of work.
    assert rows[0] == [("0F0", 0, 1), ("0F1", 1, 3), ("0B0", 6, 10), ("0B1", 10, 12)]
    assert rows[1] == [("1F0", 1, 3), ("1F1", 3, 4), ("1B0", 4, 6), ("1B1", 6, 10)]
    assert max(end for row in rows for _, _, end in row) == pytest.approx(12.0)


def test_efficiency_slows_only_shared_time() -> None:
    rows = compute_spans("gpipe", 2, 2, Sharing.of([0, 0], efficiency=0.5))
    assert rows[0][:2] == [("0F0", 0.0, 1.0), ("0F1", 1.0, 5.0)]  # shared at 0.25 each
    assert rows[1][0] == ("1F0", 1.0, 5.0)


def test_lockstep_copies_load_a_processor() -> None:
    # one rank standing for itself and a copy on the same processor: half speed throughout
    rows = compute_spans("gpipe", 1, 2, Sharing((0,), ((2,),)))
    assert rows[0] == [("0F0", 0.0, 2.0), ("0F1", 2.0, 4.0), ("0B0", 4.0, 8.0), ("0B1", 8.0, 12.0)]


def test_bad_sharing_is_rejected() -> None:
    with pytest.raises(ValueError, match="efficiency"):
        Sharing.of([0, 0], efficiency=0.0)
    with pytest.raises(ValueError, match="load"):
        Sharing((0, 0), ((1, 0),))
    with pytest.raises(ValueError, match="one processor per rank"):
        replay(build("1f1b", 2, 2), sharing=Sharing.of([0, 0, 0]))


def shared_cluster(devices: int, processors: int | None, efficiency: float = 1.0) -> Cluster:
    group = NodeGroup(
        device=Device(name="unit", peak_flops={"fp32": 1.0}, memory_bytes=1 << 50),
        devices_per_node=devices,
        intra_node=FREE,
        processors=processors,
        sharing_efficiency=efficiency,
    )
    return Cluster(name="shared", groups=(group,), inter_node=FREE)


def test_cluster_numbers_processors_per_node() -> None:
    one = shared_cluster(4, 2)
    assert [one.processor(r) for r in range(4)] == [0, 1, 0, 1] and one.shares_processors
    two = one.with_nodes(2)
    assert [two.processor(r) for r in range(8)] == [0, 1, 0, 1, 4, 5, 4, 5]
    own = shared_cluster(4, None)
    assert [own.processor(r) for r in range(4)] == [0, 1, 2, 3] and not own.shares_processors
    with pytest.raises(ValueError, match="processors=0"):
        shared_cluster(4, 0)
    with pytest.raises(ValueError, match="sharing_efficiency"):
        shared_cluster(4, 2, efficiency=1.5)


UNIT = BlockCost(name="unit", forward_flops=1.0, backward_input_flops=1.0,
                 backward_weight_flops=1.0)  # fmt: skip


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_a_pipeline_on_one_processor_takes_all_its_work(kind: str) -> None:
    plan = SimPlan(pp=2, microbatches=4, schedule=kind, dtype="fp32")
    alone = simulate(build_schedule(plan), [UNIT] * 2, shared_cluster(2, None), plan)
    shared = simulate(build_schedule(plan), [UNIT] * 2, shared_cluster(2, 1), plan)
    assert alone.step_time_s <= (4 + 1) * 3 + 1e-9  # ZB-H1 fills part of the bubble
    assert shared.step_time_s == pytest.approx(2 * 4 * 3)  # the processor never idles


def test_data_parallel_replicas_on_one_processor_load_it() -> None:
    plan = SimPlan(dp=2, pp=1, microbatches=3, schedule="1f1b", dtype="fp32")
    alone = simulate(build_schedule(plan), [UNIT], shared_cluster(2, None), plan)
    shared = simulate(build_schedule(plan), [UNIT], shared_cluster(2, 1), plan)
    slow = simulate(build_schedule(plan), [UNIT], shared_cluster(2, 1, efficiency=0.5), plan)
    assert alone.step_time_s == pytest.approx(9.0)
    assert shared.step_time_s == pytest.approx(18.0)
    assert slow.step_time_s == pytest.approx(36.0)


def test_cpu_cores_for() -> None:
    assert cpu_cores_for(0, 2, [0, 1, 2, 3]) == {0, 1}
    assert cpu_cores_for(1, 2, [0, 1, 2, 3]) == {2, 3}
    assert cpu_cores_for(2, 3, [4, 5, 6, 7]) == {6}  # a core left over stays unused
    assert [cpu_cores_for(r, 4, [0, 1]) for r in range(4)] == [{0}, {1}, {0}, {1}]
    with pytest.raises(ValueError, match="local rank 4"):
        cpu_cores_for(4, 4, [0, 1])


def test_shared_cluster_round_trips_through_toml() -> None:
    import tomllib

    from plait.presets import cluster_from_toml, cluster_to_toml

    cluster = shared_cluster(4, 2, efficiency=0.75)
    back = cluster_from_toml(tomllib.loads(cluster_to_toml(cluster)), default_name="shared")
    assert back == cluster and [back.processor(r) for r in range(4)] == [0, 1, 0, 1]


def test_fit_efficiency_solves_a_falling_prediction() -> None:
    assert fit_efficiency(lambda e: 1.0 / e, 2.0) == pytest.approx(0.5, abs=1e-4)
    assert fit_efficiency(lambda e: 1.0 / e, 0.5) == pytest.approx(1.0, abs=1e-4)  # bound


def _declared(slowdowns: tuple[float, ...], memory: tuple[int, ...]) -> Cluster:
    """A cluster file's devices: one node per run of one kind."""
    link = Link(latency_s=1e-5, bandwidth_Bps=1e9)
    groups, first = [], 0
    while first < len(slowdowns):
        n = 1
        while first + n < len(slowdowns) and (slowdowns[first + n], memory[first + n]) == (
            slowdowns[first],
            memory[first],
        ):
            n += 1
        device = Device(name=f"kind{first}", peak_flops={"fp32": 1e12},
                        memory_bytes=memory[first], slowdown=slowdowns[first])  # fmt: skip
        groups.append(NodeGroup(device=device, devices_per_node=n, intra_node=link))
        first += n
    return Cluster(name="declared", groups=tuple(groups), inter_node=link)


def test_a_declared_cluster_makes_a_node_of_each_kind_on_cores_of_their_own() -> None:
    """`--cluster FILE`: the planner sees the file's devices (their slowdown, their memory
    up to a worker's share, their nodes), each on a core of its own however few cores this
    host has: the file states the hardware, so pipelines of different depths are planned."""
    from plait.train.planinputs import local_cluster

    link = Link(latency_s=1e-5, bandwidth_Bps=1e9)
    declared = _declared((1.0, 1.0, 3.0, 3.0), (2**40, 2**40, 2**20, 2**20))
    cluster = local_cluster(3, link, cores=2, declared=declared)
    assert [g.devices_per_node for g in cluster.groups] == [2, 1]
    assert [g.device.slowdown for g in cluster.groups] == [1.0, 3.0]
    assert [g.device.name for g in cluster.groups] == ["kind0", "kind2"]
    fast, slow = (g.device.achievable_flops("fp32") for g in cluster.groups)
    assert fast == pytest.approx(3 * slow)
    assert cluster.groups[1].device.memory_bytes == 2**20
    assert cluster.groups[0].device.memory_bytes < 2**40  # at most a worker's share here
    assert not cluster.shares_processors  # 3 workers on 2 cores: the file says otherwise
    assert local_cluster(3, link, cores=2).shares_processors  # measured: they share
    same = _declared((2.0,) * 3, (2**30,) * 3)
    assert len(local_cluster(3, link, cores=4, declared=same).groups) == 1  # one kind
