"""The planner: its choice equals brute-force simulation of the whole space; infeasible
inputs say what is short; unequal devices get speed-proportional splits and shares."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import StageCost
from plait.plan import NoFeasiblePlan, SearchSpace, describe, gpt_spec, partition_blocks, search
from plait.plan.estimate import inflight
from plait.plan.explain import explain
from plait.plan.hetero import plan_replicas, shares
from plait.presets import load_cluster
from plait.sim import SimPlan, build_schedule, simulate

GIB = 2**30
LINK = Link(latency_s=5e-6, bandwidth_Bps=100e9)
SLOW_NET = Link(latency_s=1e-5, bandwidth_Bps=12.5e9)


def _device(name: str, tflops: float, gib: float) -> Device:
    return Device(name=name, peak_flops={"bf16": tflops * 1e12}, efficiency=0.5,
                  memory_bytes=int(gib * GIB))  # fmt: skip


def _cluster(*groups: tuple[Device, int, int]) -> Cluster:
    return Cluster(
        name="test",
        groups=tuple(NodeGroup(device=d, devices_per_node=n, intra_node=LINK, num_nodes=k)
                     for d, n, k in groups),
        inter_node=SLOW_NET,
    )  # fmt: skip


MODEL = gpt_spec(num_layers=6, hidden=1024, num_heads=8, seq_len=512, vocab_size=8000)
SPACE = SearchSpace(micro_batch_sizes=(1, 2, 4), chunks=(2,))


def _brute_force(cluster: Cluster, global_batch: int, margin: float = 0.05) -> float:
    """Every plan, partitioned exactly and simulated; the fastest that fits."""
    best = float("inf")
    n = cluster.num_devices
    for dp, tp, pp in itertools.product(range(1, n + 1), repeat=3):
        if dp * tp * pp != n or MODEL.num_heads % tp or 2 % tp or pp > MODEL.num_blocks:
            continue
        for b in SPACE.micro_batch_sizes:
            if global_batch % (dp * b):
                continue
            kinds = (
                [("1f1b", 1)]
                if pp == 1
                else [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)]
            )
            for (kind, v), rc, zero, sp in itertools.product(
                kinds,
                SPACE.recompute,
                (0, 1, 2, 3) if dp > 1 else (0,),
                (False, True) if tp > 1 else (False,),
            ):
                if pp * v > MODEL.num_blocks:
                    continue
                plan = SimPlan(
                    dp=dp,
                    tp=tp,
                    pp=pp,
                    schedule=kind,
                    microbatches=global_batch // (dp * b),
                    micro_batch_size=b,
                    chunks=v,
                    recompute=rc,
                    zero=zero,
                    sequence_parallel=sp,
                    seq_len=MODEL.seq_len,
                )
                step = _simulate(plan, cluster, margin)
                best = min(best, step)
    return best


def _simulate(plan: SimPlan, cluster: Cluster, margin: float) -> float:
    blocks = MODEL.blocks(plan.micro_batch_size, plan)
    k = plan.pp * plan.chunks
    counts = [
        max(
            1,
            round(inflight(plan.schedule, plan.pp, plan.microbatches, plan.chunks, s % plan.pp)),
        )
        for s in range(k)
    ]
    try:
        part = partition_blocks(
            blocks,
            [cluster.device(plan.global_rank(s % plan.pp)) for s in range(k)],
            dtype=plan.dtype,
            recompute=plan.recompute,
            inflight=counts,
            layout=plan,
        )
    except ValueError:
        return float("inf")
    stages = [StageCost(tuple(x)) for x in part.split(list(blocks))]
    result = simulate(build_schedule(plan), stages, cluster, plan)
    spare = min((r.capacity_bytes - r.memory.total) / r.capacity_bytes for r in result.ranks)
    return result.step_time_s if spare >= margin else float("inf")


@pytest.mark.parametrize("gib", [80.0, 6.0])
def test_planner_pick_equals_brute_force(gib: float) -> None:
    cluster = _cluster((_device("gpu", 100, gib), 2, 2))
    # force the estimate-then-simulate path: the estimates must put the best plan in
    # the few that are simulated
    found = search(MODEL, cluster, global_batch=16, space=SPACE, exact_limit=0, max_simulated=12)
    best = _brute_force(cluster, 16)
    # equally fast plans (within 0.1%) are ordered by simplicity, so compare at that grain
    assert found.best.step_time_s == pytest.approx(best, rel=2e-3), describe(found.best.plan)
    exhaustive = search(MODEL, cluster, global_batch=16, space=SPACE, exact_limit=10**6)
    assert exhaustive.best.step_time_s == pytest.approx(best, rel=2e-3)


def test_the_search_stops_on_replayed_work_not_on_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The estimate-then-simulate path decides the same on a slow machine: a clock that
    jumps 1000 s at each read changes nothing; the replay budget alone sets the count."""
    import importlib

    module = importlib.import_module("plait.plan.search")
    cluster = _cluster((_device("gpu", 100, 80.0), 2, 2))  # every plan fits
    kwargs: dict[str, Any] = dict(global_batch=16, space=SPACE, exact_limit=0,
                                  max_simulated=12, top_k=3)  # fmt: skip
    order: list[SimPlan] = []
    exact_of = module.exact_of
    monkeypatch.setattr(module, "exact_of", lambda plan, c: order.append(plan) or exact_of(plan, c))
    plain = search(MODEL, cluster, **kwargs)
    ticks = iter(range(0, 10**9, 1000))
    with monkeypatch.context() as patch:
        patch.setattr(module.time, "perf_counter", lambda: float(next(ticks)))
        slow = search(MODEL, cluster, **kwargs)
    assert slow.num_simulated == plain.num_simulated == 12  # small plans: within the budget
    assert [r.plan for r in slow.ranked] == [r.plan for r in plain.ranked]
    # no budget: it stops once top_k fit; a budget of the first five plans' work: after them
    assert search(MODEL, cluster, replay_budget=0, **kwargs).num_simulated == 3
    work = sum(p.pp * p.chunks * p.microbatches for p in order[:5])
    assert search(MODEL, cluster, replay_budget=work, **kwargs).num_simulated == 5


def test_explanation_names_gains_and_costs() -> None:
    cluster = _cluster((_device("gpu", 100, 80), 2, 2))
    # ZB-H2 would tie ZB-H1 here (two stages): the tie is explained in its own test
    space = dataclasses.replace(SPACE, schedules=("1f1b", "gpipe", "zb-h1", "interleaved"))
    found = search(MODEL, cluster, global_batch=16, space=space)
    text = explain(found)
    assert text.startswith(describe(found.ranked[0].plan)) and " beats " in text
    assert "Memory headroom" in text and ("gains" in text or "pays" in text)


def test_nothing_fits_says_what_is_short_and_what_helps() -> None:
    big = gpt_spec(num_layers=96, hidden=12288, num_heads=96, seq_len=2048, vocab_size=51200)
    with pytest.raises(NoFeasiblePlan) as err:
        search(big, load_cluster("dgx-a100-80gb", num_nodes=1), global_batch=64)
    text = str(err.value)
    assert "memory is short" in text and "GiB over" in text
    assert "more devices (about" in text
    with pytest.raises(NoFeasiblePlan, match="divides global_batch=7"):
        search(
            MODEL,
            _cluster((_device("gpu", 100, 80), 2, 2)),
            global_batch=7,
            space=SearchSpace(micro_batch_sizes=(2,)),
        )


def test_unequal_devices_get_speed_proportional_splits_and_shares() -> None:
    fast, slow = _device("fast", 200, 80), _device("slow", 100, 80)
    cluster = _cluster((fast, 2, 1), (slow, 2, 1))
    # pipelines inside one node kind: the fast pipeline takes twice the micro-batches
    plan = SimPlan(dp=2, pp=2, microbatches=12, seq_len=MODEL.seq_len, rank_order="tp-pp-dp")
    het = plan_replicas(plan, MODEL, cluster)
    assert [r.devices for r in het.replicas] == [("fast", "fast"), ("slow", "slow")]
    assert [r.num_microbatches for r in het.replicas] == [16, 8]
    ends = [r.run.step_time_s for r in het.replicas]
    assert max(ends) / min(ends) < 1.15  # shares balance the finish times
    # pipelines across node kinds: the fast stage takes more blocks
    spread = plan_replicas(
        SimPlan(dp=2, pp=2, microbatches=12, seq_len=MODEL.seq_len), MODEL, cluster
    )
    first = spread.replicas[0]
    assert first.devices == ("fast", "slow") and first.sizes[0] > first.sizes[1]
    found = search(
        MODEL,
        cluster,
        global_batch=24,
        space=SearchSpace(
            micro_batch_sizes=(1,),
            recompute=("none",),
            zero_stages=(0,),
            schedules=("1f1b",),
            rank_orders=("tp-dp-pp", "tp-pp-dp"),
        ),
    )
    assert found.best.hetero is not None


def test_shares_are_proportional_and_complete() -> None:
    assert shares(12, [2.0, 1.0]) == [8, 4]
    assert sum(shares(10, [3.0, 1.0, 1.0])) == 10
    with pytest.raises(ValueError, match="2 micro-batches cannot feed 3 pipelines"):
        shares(2, [1.0, 1.0, 1.0])


def test_gpt3_175b_on_128_gpus_plans() -> None:
    """A model that fits no node alone, searched over every layout of 16 DGX A100 nodes: the
    search that `plait bench scale` times at 3072 GPUs (the trillion-parameter case), on a
    world with fewer layouts to try (seconds, not minutes); how long the search takes is
    that bench's (a CPU-time bound here failed on loaded machines)."""
    from plait.plan import gpt_spec, search
    from plait.presets import load_cluster

    model = gpt_spec(num_layers=96, hidden=12288, num_heads=96, seq_len=2048, vocab_size=51200)
    found = search(model, load_cluster("dgx-a100-80gb", num_nodes=16), global_batch=512)
    best = found.best.plan
    assert best.world_size == 128 and 8 % best.tp == 0 and best.pp > 1
    assert 0.2 < found.best.mfu < 0.8


def test_plan_cli_json_and_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli.main import main
    from plait.plan.io import plan_from_dict, read_plan

    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--layers",
            "6",
            "--hidden",
            "1024",
            "--heads",
            "8",
            "--seq-len",
            "512",
            "--vocab",
            "8000",
            "--cluster",
            "dgx-a100-80gb",
            "--devices",
            "4",
            "--batch-size",
            "16",
            "--top",
            "3",
            "--json",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert {"plans", "best", "explanation", "plan_seconds"} <= set(data)
    assert len(data["plans"]) == 3
    best = data["best"]
    assert best["dp"] * best["tp"] * best["pp"] == 4 and "step_time_s" in best["predicted"]
    plan = plan_from_dict(read_plan(out))
    assert plan.global_batch_size == 16
    # `plait simulate --plan` replays the same plan: the same prediction
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["step_time_s"] == pytest.approx(best["predicted"]["step_time_s"], rel=1e-6)
    assert replayed["fits"] is True
    assert main(["plan", "--cluster", "dgx-a100-80gb", "--batch-size", "0"]) == 2


def test_memory_shortfall_carries_the_excess() -> None:
    from plait.plan import MemoryShortfall, partition

    with pytest.raises(MemoryShortfall) as err:
        partition([1.0, 1.0, 1.0], 2, static_bytes=[10.0, 10.0, 10.0], memory_caps=[12.0, 12.0])
    assert err.value.excess_bytes == pytest.approx(8.0)  # best split puts 20 bytes on a stage


def test_asynchronous_kinds_need_allow_staleness() -> None:
    with pytest.raises(ValueError, match=r"update on stale weights.*allow_staleness=True"):
        SearchSpace(schedules=("1f1b", "pipedream"))
    assert "pipedream" not in SearchSpace().schedules
    assert {"pipedream", "2bw", "spectrain", "xpipe"} <= set(
        SearchSpace(allow_staleness=True).schedules
    )


def test_asynchronous_plans_are_searched_simulated_and_explained() -> None:
    """Four single-device nodes (no tensor parallelism) on a slow network, four
    micro-batches: 1F1B over four stages idles a large share of each step, a 2BW stream
    less; the search simulates both and the explanation says what 2BW's staleness costs
    against the best synchronous plan."""
    cluster = _cluster((_device("gpu", 100, 80), 1, 4))
    space = SearchSpace(schedules=("1f1b", "2bw"), allow_staleness=True, micro_batch_sizes=(1,),
                        recompute=("none",), zero_stages=(0,))  # fmt: skip
    found = search(MODEL, cluster, global_batch=4, space=space, num_devices=4)
    assert {r.plan.schedule for r in found.ranked} == {"1f1b", "2bw"}
    by_kind = {r.plan.schedule: r for r in found.ranked if r.plan.pp == 4}
    assert by_kind["2bw"].bubble_fraction < by_kind["1f1b"].bubble_fraction
    assert found.best.plan.schedule == "2bw"
    best_sync = min(r.step_time_s for r in found.ranked if r.plan.schedule == "1f1b")
    text = explain(found)
    assert "trains asynchronously" in text and "one update old" in text
    assert f"{best_sync:.3g} s per step" in text
