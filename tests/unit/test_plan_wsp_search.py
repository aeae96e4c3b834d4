"""WSP's D inside the planner's search: with an allowance, data-parallel plans compete at
their WSP pace, so where a slow link makes the synchronous gradient reduction costly a
WSP plan wins; its D and pace are those of an emulator of the wave rule written here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost.comm import all_reduce_time
from plait.plan import SearchSpace, gpt_spec, search
from plait.plan.exact import RankedPlan

FAST = Link(latency_s=1e-6, bandwidth_Bps=1e11)
SLOW = Link(latency_s=1e-5, bandwidth_Bps=1e8)
DEVICE = Device(name="u", peak_flops={"fp32": 1e11}, memory_bytes=16 * 2**30)
CLUSTER = Cluster(name="two", inter_node=SLOW, groups=(
    NodeGroup(device=DEVICE, devices_per_node=1, intra_node=FAST, num_nodes=2),))  # fmt: skip
MODEL = gpt_spec(num_layers=4, hidden=256, num_heads=4, seq_len=64, vocab_size=512, dtype="fp32")
SPACE = SearchSpace(dtype="fp32", micro_batch_sizes=(2,), zero_stages=(0,), recompute=("none",))


def _pace(wave_s: float, exchange_s: float, d: int, waves: int = 64) -> float:
    """Two equal workers under the wave rule: a worker begins wave c once it finished
    c - 1 and the exchange of wave c - d - 1 completed; the exchange of wave c completes
    `exchange_s` after both finished c. The steady seconds per wave."""
    end = [0.0, 0.0]
    done: list[float] = []  # when each wave's exchange completed
    finished: list[float] = []
    for c in range(waves):
        ready = done[c - d - 1] if c - d - 1 >= 0 else 0.0
        end = [max(e, ready) + wave_s for e in end]
        finished.append(max(end))
        done.append(max(end) + exchange_s)
    half = waves // 2
    return (finished[-1] - finished[half - 1]) / (waves - half)


def _sync_of(found: object, plan: object) -> RankedPlan:
    sync = dataclasses.replace(plan, wsp_staleness=None)  # type: ignore[type-var]
    return next(r for r in found.ranked if r.plan == sync)  # type: ignore[attr-defined]


@pytest.mark.parametrize("allowance", [0, 1, 2])
def test_wsp_competes_in_the_search_at_the_emulated_pace(allowance: int) -> None:
    synchronous = search(MODEL, CLUSTER, global_batch=16, space=SPACE)
    found = search(MODEL, CLUSTER, global_batch=16, space=SPACE, wsp_allowance=allowance)
    stale = [r for r in found.ranked if r.plan.wsp_staleness is not None]
    assert stale and all(r.plan.dp >= 2 and r.plan.tp == 1 for r in stale)
    for r in stale:
        sync = _sync_of(found, r.plan)
        assert sync.result is not None
        wave = sync.result.pipeline_time_s + max(x.optimizer_s for x in sync.result.ranks)
        params = sum(b.num_params for b in MODEL.blocks_for(r.plan)[: sync.sizes[0]])
        exchange = all_reduce_time(2, 4.0 * params, SLOW)
        paces = [_pace(wave, exchange, d) for d in range(allowance + 1)]
        least = next(d for d, p in enumerate(paces) if p <= min(paces) * 1.01)
        assert r.plan.wsp_staleness == least
        assert r.step_time_s == pytest.approx(paces[least], rel=1e-6)
    best_sync = synchronous.best.step_time_s
    best_stale = min(r.step_time_s for r in stale)
    # the pick is the faster of the synchronous best and the best plan under WSP
    assert found.best.step_time_s == pytest.approx(min(best_sync, best_stale), rel=1e-3)
    if allowance == 2:  # hiding the slow exchange behind two waves beats every pipeline
        assert found.best.plan.wsp_staleness == 2 and best_stale < best_sync
        assert synchronous.best.plan.dp == 1


def test_no_plan_takes_wsp_where_training_refuses_it() -> None:
    space = dataclasses.replace(SPACE, zero_stages=(0, 1, 2))
    found = search(MODEL, CLUSTER, global_batch=16, space=space, wsp_allowance=1)
    for r in found.ranked:
        if r.plan.wsp_staleness is not None:
            r.plan.parallel_plan()  # the training plan's own checks (ZeRO, tp, ...) pass
            assert r.plan.zero == 0 and r.plan.tp == 1
    with pytest.raises(ValueError, match="wsp_allowance=-1"):
        search(MODEL, CLUSTER, global_batch=16, space=SPACE, wsp_allowance=-1)


def test_plait_simulate_replays_the_planned_wsp_plan_at_its_predicted_pace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.cli.main import main

    cluster = tmp_path / "c.toml"
    cluster.write_text(
        'name = "two-slow-link"\n'
        f"inter_node = {{ latency_s = {SLOW.latency_s}, bandwidth_Bps = {SLOW.bandwidth_Bps} }}\n"
        "[[nodes]]\ncount = 2\ndevices_per_node = 1\n"
        "intra_node = { latency_s = 1e-6, bandwidth_Bps = 1e11 }\n"
        'device = { name = "u", peak_flops = { fp32 = 1e11 }, memory_gib = 16 }\n'
    )
    out = tmp_path / "plan.json"
    model = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq-len", "64",
             "--vocab", "512", "--dtype", "fp32"]  # fmt: skip
    assert main(["plan", "--cluster", str(cluster), *model, "--batch-size", "16",
                 "--wsp-staleness", "2", "--out", str(out), "--json"]) == 0  # fmt: skip
    planned = json.loads(capsys.readouterr().out)
    assert planned["best"]["wsp_staleness"] == 2  # `--json` prints the plan flat
    assert "WSP: D=2" in planned["explanation"]
    assert main(["simulate", "--plan", str(out), "--cluster", str(cluster), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["wsp"]["step_time_s"] == pytest.approx(
        planned["best"]["predicted"]["step_time_s"], rel=1e-9
    )
