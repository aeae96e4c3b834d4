"""The layout: expert parallelism borrows data-parallel ranks, rank orders place ranks the
same way in the runtime mesh and the simulator, and plan files carry every field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from plait.config import ParallelPlan, TrainConfig
from plait.layout import Layout, expert_index
from plait.mesh import check_fits, expert_grid
from plait.plan.io import (
    parallel_plan_of,
    plan_from_dict,
    plan_to_dict,
    read_plan,
    write_plan,
)
from plait.plan.search import RankedPlan
from plait.sim import SimPlan


def _groups(grid: list[list[list[int]]], axis: str) -> set[frozenset[int]]:
    """Every group along `axis` of a [pp][dp][tp] grid of ranks."""
    pp, dp, tp = len(grid), len(grid[0]), len(grid[0][0])
    coords = [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]
    out: dict[tuple[int, ...], set[int]] = {}
    for p, d, t in coords:
        key = {"pp": (d, t), "dp": (p, t), "tp": (p, d)}[axis]
        out.setdefault(key, set()).add(grid[p][d][t])
    return {frozenset(g) for g in out.values()}


def _set(*groups: tuple[int, ...]) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


# a 2×2 dp × pp world under both orders the planner tries: the groups, written out by hand
ORDER_TABLE = {
    "tp-dp-pp": {"dp": _set((0, 1), (2, 3)), "pp": _set((0, 2), (1, 3))},
    "tp-pp-dp": {"dp": _set((0, 2), (1, 3)), "pp": _set((0, 1), (2, 3))},
}


@pytest.mark.parametrize("order", sorted(ORDER_TABLE))
def test_rank_order_places_the_groups_of_a_two_by_two_world(order: str) -> None:
    layout = Layout(dp_replicate=2, pp=2, rank_order=order)
    grid = [[[layout.global_rank({"pp": p, "dp": d})] for d in range(2)] for p in range(2)]
    sim = SimPlan(dp=2, pp=2, rank_order=order)
    for axis, expected in ORDER_TABLE[order].items():
        assert _groups(grid, axis) == expected, axis
    assert {frozenset(sim.dp_group(p)) for p in range(2)} == ORDER_TABLE[order]["dp"]
    for p in range(2):
        for d in range(2):
            assert sim.global_rank(p, d) == grid[p][d][0]


def test_ep_borrows_data_parallel_ranks_in_a_world_of_four() -> None:
    dims = Layout(dp_replicate=4, ep=2)
    assert dims.size == 4 and dims.degree("edp") == 2
    check_fits(dims, 4)
    # dp index = edp index · ep + ep index: ep groups are neighbouring dp ranks
    assert expert_grid(dims) == [[[0, 1], [2, 3]]]
    sim = SimPlan(dp=4, ep=2)
    assert {frozenset(sim.ep_group(0, d)) for d in range(4)} == _set((0, 1), (2, 3))
    assert {frozenset(sim.expert_dp_group(0, d)) for d in range(4)} == _set((0, 2), (1, 3))


def test_expert_groups_in_worlds_of_eight() -> None:
    # dp=4, pp=2, ep=2, tp-dp-pp: rank = dp + 4·pp
    sim = SimPlan(dp=4, pp=2, ep=2)
    eps = {frozenset(sim.ep_group(p, d)) for p in range(2) for d in range(4)}
    edps = {frozenset(sim.expert_dp_group(p, d)) for p in range(2) for d in range(4)}
    assert eps == _set((0, 1), (2, 3), (4, 5), (6, 7))
    assert edps == _set((0, 2), (1, 3), (4, 6), (5, 7))
    # ep borrows dp × tp ranks, tp innermost: dp=2, tp=2, pp=2, ep=2, tp-dp-pp
    # (rank = tp + 2·dp + 4·pp): an ep group is a replica's tp group, the experts' replicas
    # are the same tp rank of the other replica
    sim = SimPlan(dp=2, tp=2, pp=2, ep=2)
    eps = {frozenset(sim.ep_group(p, d, t)) for p in range(2) for d in range(2) for t in range(2)}
    assert eps == _set((0, 1), (2, 3), (4, 5), (6, 7))
    assert sim.expert_dp_group(1, 1, 1) == [5, 7]
    grid = expert_grid(Layout(dp_replicate=2, tp=2, pp=2, ep=2))  # [pp][edp][ep]
    assert grid == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # ep=4 = dp × tp: one ep group per stage, every expert once (edp=1)
    sim = SimPlan(dp=2, tp=2, pp=2, ep=4)
    assert sim.ep_group(1, 1, 0) == [4, 5, 6, 7] and sim.expert_dp_group(1, 1, 1) == [7]
    assert expert_grid(Layout(dp_replicate=2, tp=2, pp=2, ep=4)) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # dp=4, tp=2, ep=4 under tp-pp-dp: rank = tp + 2·dp; flat (dp, tp) index = rank
    sim = SimPlan(dp=4, tp=2, ep=4, rank_order="tp-pp-dp")
    assert {frozenset(sim.ep_group(0, d, t)) for d in range(4) for t in range(2)} == _set(
        (0, 1, 2, 3), (4, 5, 6, 7)
    )
    assert sim.expert_dp_group(0, 3, 1) == [3, 7]
    # ep=3 of dp × tp = 3 × 2 under dp-tp-pp (rank = dp + 3·tp): groups cross replicas
    sim = SimPlan(dp=3, tp=2, ep=3, rank_order="dp-tp-pp")
    assert sim.ep_group(0, 1, 1) == [4, 2, 5]  # flat 3, 4, 5 = (1, 1), (2, 0), (2, 1)
    grid = expert_grid(Layout(dp_replicate=3, tp=2, ep=3, rank_order="dp-tp-pp"))
    assert grid == [[[0, 3, 1], [4, 2, 5]]]
    assert expert_index(1, 3, tp_index=1, tp=2) == (1, 0)


def test_ep_must_divide_dp_times_tp_and_adds_no_ranks() -> None:
    for make in (
        lambda: Layout(dp_replicate=4, ep=3),
        lambda: SimPlan(dp=4, ep=3),
        lambda: ParallelPlan(dp=4, pp=1, ep=3),
    ):
        with pytest.raises(ValueError, match=r"ep=3 does not divide dp × tp = 4 × 1.*\[1, 2, 4\]"):
            make()
    with pytest.raises(ValueError, match=r"ep=4 does not divide dp × tp = 1 × 2"):
        Layout(dp_replicate=1, tp=2, ep=4)
    assert (
        Layout(dp_replicate=1, tp=2, ep=2).degree("edp") == 1
        and Layout(dp_replicate=2, tp=2, ep=1).degree("edp") == 4
    )
    with pytest.raises(ValueError, match="ep=0 must be a positive integer"):
        Layout(dp_replicate=2, ep=0)
    with pytest.raises(
        ValueError, match=r"holds 2 ranks \(dp_replicate=2\), not the 4 workers.*ep=2"
    ):
        check_fits(Layout(dp_replicate=2, ep=2), 4)


def test_an_unknown_rank_order_is_refused_naming_the_field() -> None:
    for make in (
        lambda: Layout(rank_order="dp-tp"),
        lambda: SimPlan(rank_order="dp-tp"),
        lambda: ParallelPlan(rank_order="dp-tp"),
    ):
        with pytest.raises(ValueError, match="rank_order='dp-tp' is unknown"):
            make()


def test_a_tensor_parallel_group_must_stay_consecutive_across_nodes() -> None:
    with pytest.raises(ValueError, match="rank_order='dp-tp-pp' with tp=2"):
        check_fits(Layout(dp_replicate=2, tp=2, rank_order="dp-tp-pp"), 4, local_world_size=2)
    check_fits(Layout(dp_replicate=2, tp=2, rank_order="tp-pp-dp"), 4, local_world_size=2)


def test_ep_needs_a_model_with_experts() -> None:
    with pytest.raises(ValueError, match=r"ep=2 with model 'gpt'.*moe-gpt"):
        TrainConfig(parallel=ParallelPlan(dp=2, pp=1, ep=2))


# ---- plan files: every field of every plan type has its counterpart ----


def test_the_simulators_plan_is_the_training_layout_plus_the_batch_shape() -> None:
    """One plan type: every ParallelPlan field is a SimPlan field of the same meaning, and
    a SimPlan gives training back exactly its layout."""
    parallel = {f.name for f in dataclasses.fields(ParallelPlan)}
    sim = {f.name for f in dataclasses.fields(SimPlan)}
    # the batch shape, and how the replicas share it when it does not divide equally
    shape = {"micro_batch_size", "seq_len", "optimizer", "total_microbatches", "single_process"}
    assert parallel <= sim and sim - parallel == shape
    layout = ParallelPlan(dp=2, pp=2, ep=2, microbatches=4, rank_order="dp-tp-pp",
                          compress="fp16", schedule="zb-h1", partition=(2, 3))  # fmt: skip
    plan = SimPlan.of(layout, micro_batch_size=3, seq_len=16)
    assert plan.parallel_plan() == layout and plan.global_batch_size == 2 * 4 * 3


def test_training_refuses_what_the_simulator_only_prices() -> None:
    SimPlan(dp=1, zero=1, dtype="tf32", schedule="pipedream", tp=2)  # priced, not trained
    with pytest.raises(ValueError, match="dtype='tf32'"):
        SimPlan(dtype="tf32").parallel_plan()
    with pytest.raises(ValueError, match="zero=1 with dp=1"):
        SimPlan(zero=1, dtype="fp32").parallel_plan()


def _ranked(plan: SimPlan, sizes: tuple[int, ...]) -> RankedPlan:
    values = {"plan": plan, "sizes": sizes, "step_time_s": 1.0, "tokens_per_s": 2.0,
              "mfu": 0.5, "bubble_fraction": 0.25, "comm_share": 0.125,
              "peak_memory_bytes": (1.0, 2.0), "capacity_bytes": (4.0, 4.0)}  # fmt: skip
    return RankedPlan(**values)  # type: ignore[arg-type]


def test_a_plan_file_round_trips_every_field(tmp_path: Path) -> None:
    plan = SimPlan(
        dp=4, tp=1, pp=2, ep=2, schedule="interleaved", microbatches=4, micro_batch_size=2,
        chunks=2, recompute="full", zero=1, dtype="fp32", seq_len=32,
        rank_order="tp-pp-dp", compress="bf16", partition=(1, 1, 1, 1),
    )  # fmt: skip
    model = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32}
    path = tmp_path / "plan.json"
    write_plan(path, plan_to_dict(_ranked(plan, (1, 1, 1, 1)), model=model))
    data = read_plan(path)
    assert plan_from_dict(data) == plan
    assert parallel_plan_of(data) == plan.parallel_plan()


def test_a_hand_written_plan_file_reads_the_same_to_training_and_the_simulator() -> None:
    data = {"dp": 2, "tp": 1, "pp": 2, "schedule": "1f1b", "microbatches": 2}
    assert plan_from_dict(data).parallel_plan() == parallel_plan_of(data)


def test_plait_train_takes_every_field_of_a_plan_file(tmp_path: Path) -> None:
    from plait.cli.train_config import from_plan_file as _from_plan_file

    plan = SimPlan(dp=2, pp=2, microbatches=2, micro_batch_size=2, rank_order="tp-pp-dp")
    model = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32}
    path = tmp_path / "plan.json"
    write_plan(path, plan_to_dict(_ranked(plan, (2, 2)), model=model))
    out = _from_plan_file(str(path), {}, {})
    layout = ParallelPlan(**{k[9:]: v for k, v in out.items() if k.startswith("parallel.")})
    assert layout == parallel_plan_of(read_plan(path))
    assert layout.rank_order == "tp-pp-dp" and layout.ep == 1 and layout.partition == (2, 2)


def test_a_heterogeneous_plan_file_trains_its_pipelines(tmp_path: Path) -> None:
    data = plan_to_dict(_ranked(SimPlan(dp=2, pp=2, microbatches=2), (2, 2)))
    data["pipelines"] = [
        {"devices": ["a100", "a100"], "partition": [3, 1], "microbatches": 3},
        {"devices": ["t4", "t4"], "partition": [1, 3], "microbatches": 1},
    ]
    layout = parallel_plan_of(data)
    assert layout.pipelines is not None
    assert [(p.partition, p.microbatches, p.devices) for p in layout.pipelines] == [
        ((3, 1), 3, ("a100", "a100")),
        ((1, 3), 1, ("t4", "t4")),
    ]
    assert layout.world_size == 4
    data["pipelines"][1]["partition"] = [1, 2]  # a pipeline that drops a block
    with pytest.raises(ValueError, match="cut different numbers of blocks"):
        parallel_plan_of(data)
    data["pipelines"] = 3
    with pytest.raises(ValueError, match="pipelines=3"):
        parallel_plan_of(data)


def test_plait_train_adopts_a_moe_plans_model(tmp_path: Path) -> None:
    from plait.cli.train_config import from_plan_file as _from_plan_file

    plan = SimPlan(dp=2, pp=1, ep=2, microbatches=2, micro_batch_size=2)
    model = {"name": "moe-gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32,
             "ffn_hidden": 128, "experts": 4, "top_k": 2, "capacity_factor": 1.5,
             "moe_every": 1, "shared_expert": True, "imbalance": 1.0, "vocab": 64}  # fmt: skip
    path = tmp_path / "plan.json"
    write_plan(path, plan_to_dict(_ranked(plan, (4,)), model=model))
    out = _from_plan_file(str(path), {}, {})
    adopted = {k[6:]: v for k, v in out.items() if k.startswith("model.")}
    expected = {k: v for k, v in model.items() if k not in ("imbalance", "vocab")}
    assert adopted == expected and out["parallel.ep"] == 2
    with pytest.raises(ValueError, match="experts: plan 4, given 8"):
        _from_plan_file(str(path), {"model.experts": 8}, {})
    dense = {**model, "name": "gpt"}
    write_plan(path, plan_to_dict(_ranked(SimPlan(dp=2, microbatches=2), (4,)), model=dense))
    assert "model.name" not in _from_plan_file(str(path), {"model.name": "hf-gpt2"}, {})
