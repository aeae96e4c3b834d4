"""The simulator against closed forms, memory peaks, speed, and a GPT-3 175B sanity check."""

from __future__ import annotations

import pytest

from plait.cluster import GIB, Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost, stage_costs, transformer_block_costs
from plait.plan import partition_blocks
from plait.presets import load_cluster
from plait.schedule import build, compute_only
from plait.sim import SimPlan, build_schedule, simulate

FREE = Link(latency_s=0.0, bandwidth_Bps=1e30)


def unit_cluster(num_devices: int = 64, *, speeds: tuple[float, ...] = ()) -> Cluster:
    """Devices doing 1 FLOP/s (so FLOPs are seconds) on free links; `speeds` makes the
    first nodes (one device each) faster or slower."""
    groups = [
        NodeGroup(
            device=Device(name=f"x{s}", peak_flops={"fp32": s}, memory_bytes=1 << 50),
            devices_per_node=1,
            intra_node=FREE,
        )
        for s in speeds
    ]
    rest = num_devices - len(speeds)
    unit = Device(name="unit", peak_flops={"fp32": 1.0}, memory_bytes=1 << 50)
    if rest:
        groups.append(NodeGroup(device=unit, devices_per_node=rest, intra_node=FREE))
    return Cluster(name="unit", groups=tuple(groups), inter_node=FREE)


def unit_block(v: int = 1, *, saved: float = 1.0, params: int = 0) -> BlockCost:
    """Forward 1/v, input and weight gradients 1/v each (a full backward costs 2/v)."""
    return BlockCost(
        name="unit",
        forward_flops=1 / v,
        backward_input_flops=1 / v,
        backward_weight_flops=1 / v,
        saved_bytes=saved,
        num_params=params,
    )


def run(kind: str, p: int, m: int, v: int = 1, **plan_options: object):  # type: ignore[no-untyped-def]
    plan = SimPlan(pp=p, microbatches=m, schedule=kind, chunks=v, dtype="fp32", **plan_options)  # type: ignore[arg-type]
    return simulate(build_schedule(plan), [unit_block(v)] * (p * v), unit_cluster(), plan)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (3, 5), (4, 8), (5, 3), (8, 16)])
def test_gpipe_and_1f1b_bubble_closed_form(kind: str, p: int, m: int) -> None:
    result = run(kind, p, m)
    assert result.step_time_s == pytest.approx((m + p - 1) * 3)  # t_f + t_b = 1 + 2
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 8, 4), (2, 6, 3)])
def test_interleaved_bubble_closed_form(p: int, m: int, v: int) -> None:
    result = run("interleaved", p, m, v)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert result.step_time_s == pytest.approx(3 * m + 3 * (p - 1) / v)


@pytest.mark.parametrize(("p", "m"), [(3, 6), (4, 8), (6, 12)])
def test_zero_bubble_beats_1f1b(p: int, m: int) -> None:
    zb, base = run("zb-h1", p, m), run("1f1b", p, m)
    assert zb.bubble_fraction < base.bubble_fraction
    assert zb.step_time_s < base.step_time_s
    assert max(r.memory.activations for r in zb.ranks) <= p  # 1F1B's peak, as ZB-H1 promises


@pytest.mark.parametrize(("p", "m"), [(4, 8), (3, 7)])
def test_1f1b_holds_p_microbatches_gpipe_holds_m(p: int, m: int) -> None:
    one, gp = run("1f1b", p, m), run("gpipe", p, m)
    assert [r.memory.activations for r in one.ranks] == [p - r for r in range(p)]
    assert [r.memory.activations for r in gp.ranks] == [m] * p
    assert one.peak_memory_bytes[0] < gp.peak_memory_bytes[0]


def test_compute_only_schedule_and_timeline_labels() -> None:
    plan = SimPlan(pp=3, microbatches=4, dtype="fp32")
    schedule = build_schedule(plan)
    lowered = simulate(schedule, [unit_block()] * 3, unit_cluster(), plan)
    bare = simulate(compute_only(schedule), [unit_block()] * 3, unit_cluster(), plan)
    assert bare.step_time_s == lowered.step_time_s == pytest.approx(18)
    first = lowered.timeline[0]
    assert (first[0].label, first[0].start, first[0].end, first[0].kind) == ("0F0", 0, 1, "compute")
    assert any(e.label == "0SEND_F0" and e.kind == "comm" for e in first)
    assert first[-1].label == "0UPDATE3v1" and first[-1].kind == "optimizer"


def test_transfers_cost_latency_plus_bytes_over_bandwidth() -> None:
    slow = Link(latency_s=0.5, bandwidth_Bps=4.0)
    device = Device(name="unit", peak_flops={"fp32": 1.0}, memory_bytes=1 << 40)
    cluster = Cluster(
        name="slow",
        groups=(NodeGroup(device=device, devices_per_node=1, intra_node=FREE, num_nodes=2),),
        inter_node=slow,
    )
    block = BlockCost(name="b", forward_flops=1, backward_input_flops=2, activation_bytes=2)
    plan = SimPlan(pp=2, microbatches=1, dtype="fp32")
    result = simulate(build_schedule(plan), [block, block], cluster, plan)
    # F on rank 0, 1 s to send (0.5 + 2/4), F and B on rank 1, 1 s back, B on rank 0
    assert result.step_time_s == pytest.approx(1 + 1 + 1 + 2 + 1 + 2)
    assert result.ranks[0].p2p_s == pytest.approx(1.0)


def test_slow_device_sets_the_pace() -> None:
    plan = SimPlan(pp=2, microbatches=8, dtype="fp32")
    even = simulate(build_schedule(plan), [unit_block()] * 2, unit_cluster(2), plan)
    slow = simulate(build_schedule(plan), [unit_block()] * 2, unit_cluster(2, speeds=(0.5,)), plan)
    assert slow.ranks[0].device == "x0.5"
    # the slow stage (2 + 4 per micro-batch) is busy all the time but for the other
    # stage's share of one micro-batch (1 + 2)
    assert 8 * 6 <= slow.step_time_s <= 8 * 6 + 3
    assert slow.step_time_s > 1.8 * even.step_time_s


def test_data_parallel_reduction_and_zero() -> None:
    cluster = load_cluster("dgx-a100-80gb", num_nodes=2)
    blocks = transformer_block_costs(
        num_layers=8, hidden=2048, num_heads=16, seq_len=1024, vocab_size=32000, micro_batch_size=1
    )
    stages = stage_costs(blocks, [0, 5, 10])
    results = {}
    for dp, zero in [(1, 0), (8, 0), (8, 1), (8, 3)]:
        plan = SimPlan(dp=dp, pp=2, microbatches=4, zero=zero, seq_len=1024)
        results[dp, zero] = simulate(build_schedule(plan), stages, cluster, plan)
    one, many = results[1, 0], results[8, 0]
    assert one.ranks[0].dp_comm_s == 0 and many.ranks[0].dp_comm_s > 0
    assert any("REDUCE" in e.label and e.kind == "comm" for e in many.timeline[0])
    assert many.samples_per_s == pytest.approx(8 * 4 / many.step_time_s)
    memory = [results[8, z].ranks[0].memory for z in (0, 1, 3)]
    assert memory[0].optimizer > memory[1].optimizer == pytest.approx(memory[0].optimizer / 8)
    assert memory[2].params == pytest.approx(memory[0].params / 8)
    assert results[8, 3].step_time_s > results[8, 1].step_time_s  # per-micro-batch gathers


def test_bad_inputs_name_the_fix() -> None:
    plan = SimPlan(pp=4, microbatches=4, dtype="fp32")
    schedule = build_schedule(plan)
    with pytest.raises(ValueError, match="3 stage costs for a schedule of 4 stages"):
        simulate(schedule, [unit_block()] * 3, unit_cluster(), plan)
    with pytest.raises(ValueError, match=r"plan\.pp=2"):
        simulate(schedule, [unit_block()] * 4, unit_cluster(), SimPlan(pp=2, microbatches=4))
    with pytest.raises(ValueError, match="has 2"):
        simulate(schedule, [unit_block()] * 4, unit_cluster(2), plan)
    with pytest.raises(ValueError, match="microbatches=8"):
        simulate(schedule, [unit_block()] * 4, unit_cluster(), SimPlan(pp=4, microbatches=8))
    with pytest.raises(ValueError, match="dp=0"):
        SimPlan(dp=0)
    with pytest.raises(ValueError, match="recompute='most'"):
        SimPlan(recompute="most")  # type: ignore[arg-type]


def test_rank_order() -> None:
    plan = SimPlan(dp=2, tp=4, pp=3)
    assert [plan.global_rank(0, 0, t) for t in range(4)] == [0, 1, 2, 3]
    assert plan.global_rank(0, 1, 0) == 4 and plan.global_rank(1, 0, 0) == 8
    swapped = SimPlan(dp=2, tp=4, pp=3, rank_order="pp-tp-dp")
    assert swapped.global_rank(1, 0, 0) == 1 and swapped.global_rank(0, 0, 1) == 3
    assert sorted(
        plan.global_rank(p, d, t) for p in range(3) for d in range(2) for t in range(4)
    ) == list(range(24))


def test_64_stages_512_microbatches_bubble_is_the_closed_form() -> None:
    """The largest 1F1B the docs promise; how long it takes is `plait bench scale`'s."""
    from plait.bench.scale import simulate_64x512

    result = simulate_64x512()
    assert result.bubble_fraction == pytest.approx(63 / (512 + 63))


def gpt3_blocks(**options: object) -> list[BlockCost]:
    return transformer_block_costs(
        num_layers=96,
        hidden=12288,
        num_heads=96,
        seq_len=2048,
        vocab_size=51200,
        micro_batch_size=1,
        layout=SimPlan(tp=8),
        dropout=0.1,  # GPT-3's, with Megatron's materialized attention (Korthikanti et al.)
        **options,
    )  # type: ignore[arg-type]


def test_gpt3_175b_on_64_a100s() -> None:
    """GPT-3 175B, t=8, p=8, d=1, 64 micro-batches, full recomputation (Narayanan et al.
    2021 train it this way at larger scale and report ~50% of peak counting recompute)."""
    cluster = load_cluster("dgx-a100-80gb", num_nodes=8)
    plan = SimPlan(tp=8, pp=8, microbatches=64, recompute="full", seq_len=2048)
    blocks = gpt3_blocks()
    devices = [cluster.device(plan.global_rank(r)) for r in range(8)]
    split = partition_blocks(blocks, devices, recompute="full")
    result = simulate(build_schedule(plan), stage_costs(blocks, split.boundaries), cluster, plan)
    params = sum(b.num_params for b in blocks) * 8 - 7 * 2048 * 12288  # position table shared
    assert params == pytest.approx(175e9, rel=0.02)
    efficiency = cluster.device(0).efficiency
    # Compute runs at most at `efficiency`; recomputation adds a forward (4/3 of the work);
    # the bubble is at least (p - 1)/(m + p - 1).
    assert 0.2 < result.mfu < efficiency * 3 / 4 * (1 - 7 / 71)
    assert result.bubble_fraction >= 7 / 71 - 1e-9
    assert result.fits, result.memory_report()
    assert max(result.peak_memory_bytes) < 80 * GIB
    middle = result.ranks[3].memory
    rank_params = sum(s.num_params for s in stage_costs(blocks, split.boundaries)[3:4])
    assert middle.params + middle.grads + middle.optimizer == pytest.approx(16 * rank_params)
    assert result.tokens_per_s == pytest.approx(64 * 2048 / result.step_time_s)
    assert 0 < result.comm_share < 0.5


def test_gpt3_without_recomputation_does_not_fit() -> None:
    cluster = load_cluster("dgx-a100-80gb", num_nodes=8)
    plan = SimPlan(tp=8, pp=8, microbatches=64, seq_len=2048)
    blocks = gpt3_blocks()
    stages = stage_costs(blocks, [0, 13, 25, 37, 49, 61, 73, 85, 98])
    result = simulate(build_schedule(plan), stages, cluster, plan)
    assert not result.fits
    worst = max(result.overflows, key=lambda o: o.excess_bytes)
    assert worst.pp_rank == 0 and worst.rank in range(8)  # the first stage holds p micro-batches
    assert worst.excess_bytes > 0 and "GiB over" in str(worst)


def test_obviously_too_big_plan_names_rank_and_excess() -> None:
    cluster = load_cluster("dgx-a100-80gb")
    plan = SimPlan(tp=8, pp=1, microbatches=1, recompute="full", seq_len=2048)
    blocks = gpt3_blocks()
    result = simulate(build_schedule(plan), stage_costs(blocks, [0, len(blocks)]), cluster, plan)
    assert not result.fits
    assert {o.rank for o in result.overflows} == set(range(8))
    excess = result.overflows[0].excess_bytes
    assert excess > 16 * 170e9 / 8 - 80 * GIB  # 16 bytes per parameter, 1/8 of 175B each
    assert "rank 0 (pipeline rank 0) needs" in result.memory_report()


def test_build_schedule_matches_generators() -> None:
    plan = SimPlan(pp=4, microbatches=8, schedule="interleaved", chunks=2)
    assert build_schedule(plan) == build("interleaved", 4, 8, 2)


@pytest.mark.parametrize("kind", ["pipedream", "2bw", "spectrain", "xpipe"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 4)])
def test_asynchronous_window_in_the_steady_state_has_no_bubble(kind: str, p: int, m: int) -> None:
    """Unit costs, free links, weights of no size: a window takes m·(t_f + t_b), where
    1F1B's takes (m + p - 1)·(t_f + t_b)."""
    result, flush = run(kind, p, m), run("1f1b", p, m)
    assert result.step_time_s == pytest.approx(3 * m)
    assert result.bubble_fraction == pytest.approx(0.0, abs=1e-9)
    assert flush.step_time_s == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("kind", ["pipedream", "pipedream-vs", "2bw", "spectrain", "xpipe"])
def test_weight_copies_are_counted_in_memory(kind: str) -> None:
    """Each rank holds its closed-form number of weight copies (`plait.schedule.asynchronous`)
    of its stage's parameters (fp32: 4 bytes each), besides the live weights."""
    from plait.schedule import KINDS

    p, m, params = 4, 4, 1000
    plan = SimPlan(pp=p, microbatches=m, schedule=kind, dtype="fp32", optimizer="sgd")
    blocks = [unit_block(params=params)] * p
    result = simulate(build_schedule(plan), blocks, unit_cluster(), plan)
    copies = [r.memory.weight_copies for r in result.ranks]
    assert copies == [KINDS[kind].copies(p, m, s) * params * 4.0 for s in range(p)]
    sync = simulate(build_schedule(SimPlan(pp=p, microbatches=m, dtype="fp32")), blocks,
                    unit_cluster(), plan)  # fmt: skip
    assert all(r.memory.weight_copies == 0 for r in sync.ranks)


def test_updates_per_microbatch_cost_an_optimizer_step_each() -> None:
    """PipeDream steps each stage's optimizer m times a window, 2BW once; 2BW's last stage
    also copies its weights once a window (a pass reading and writing them)."""
    device = Device(name="slow-memory", peak_flops={"fp32": 1.0}, memory_bytes=1 << 50,
                    memory_bandwidth_Bps=1e3)  # fmt: skip
    cluster = Cluster(
        name="one",
        groups=(NodeGroup(device=device, devices_per_node=2, intra_node=FREE),),
        inter_node=FREE,
    )
    params, m = 10, 4
    # SGD in fp32 writes the parameter, reads the gradient, reads and writes the momentum
    step = params * (4 + 4 + 2 * 4) / 1e3
    copy = 2 * params * 4 / 1e3
    blocks = [unit_block(params=params)] * 2
    result = {}
    for kind in ("pipedream", "2bw"):
        plan = SimPlan(pp=2, microbatches=m, schedule=kind, dtype="fp32", optimizer="sgd")
        result[kind] = simulate(build_schedule(plan), blocks, cluster, plan)
    assert result["pipedream"].ranks[1].optimizer_s == pytest.approx(m * step)
    assert result["2bw"].ranks[1].optimizer_s == pytest.approx(step + copy)
    assert result["pipedream"].step_time_s > result["2bw"].step_time_s
