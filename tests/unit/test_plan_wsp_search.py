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


def _pace(wave_s: float | list[float], exchange_s: float, d: int, waves: int = 64) -> float:
    """Workers under the wave rule (two equal ones for a number): a worker begins wave c
    once it finished c - 1 and the exchange of wave c - d - 1 completed; the exchange of
    wave c completes `exchange_s` after all finished c. The steady seconds per wave, over
    whole cycles of d + 1 waves in the second half."""
    times = [wave_s, wave_s] if isinstance(wave_s, float) else list(wave_s)
    end = [0.0] * len(times)
    done: list[float] = []  # when each wave's exchange completed
    finished: list[float] = []
    for c in range(waves):
        ready = done[c - d - 1] if c - d - 1 >= 0 else 0.0
        end = [max(e, ready) + t for e, t in zip(end, times, strict=True)]
        finished.append(max(end))
        done.append(max(end) + exchange_s)
    span = (d + 1) * (waves // 2 // (d + 1))
    return (finished[-1] - finished[-1 - span]) / span


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


def test_d_stays_within_what_memory_holds_beside_wsp_copies() -> None:
    """WSP keeps a snapshot and, per wave not yet taken in, an update and a buffer of the
    weights (1 + 2(D + 1) copies): where memory holds D = 1's copies but not D = 2's, the
    search takes D = 1 although D = 2 would go faster (and D = 1's pace loses to the best
    pipeline here, so the pick is synchronous)."""
    roomy = search(MODEL, CLUSTER, global_batch=16, space=SPACE, wsp_allowance=2)
    best = roomy.best
    assert best.plan.wsp_staleness == 2
    sync = _sync_of(roomy, best.plan)
    weights = 4.0 * sum(b.num_params for b in MODEL.blocks_for(best.plan))  # one stage: all
    peak = max(sync.peak_memory_bytes)
    room = (peak + weights * (1 + 2 * 2) + peak + weights * (1 + 2 * 3)) / 2  # D=1 < room < D=2
    tight = dataclasses.replace(DEVICE, memory_bytes=int(room / (1 - 0.05)))
    cluster = dataclasses.replace(
        CLUSTER, groups=(dataclasses.replace(CLUSTER.groups[0], device=tight),)
    )
    found = search(MODEL, cluster, global_batch=16, space=SPACE, wsp_allowance=2)
    stale = [r for r in found.ranked if r.plan.wsp_staleness is not None]
    assert max(r.plan.wsp_staleness for r in stale) == 1
    assert found.best.plan.wsp_staleness is None
    assert found.best.step_time_s < min(r.step_time_s for r in stale)
    for r in stale:
        assert r.plan.wsp_staleness <= 1
        assert max(r.peak_memory_bytes) <= (1 - 0.05) * tight.memory_bytes


def test_plait_simulate_replays_pipelines_of_different_depths_under_wsp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The waves of unequal workers (a 2-deep and a 4-deep pipeline) against the emulator."""
    from plait.cli.main import main

    root = Path(__file__).resolve().parents[2]
    examples = root / "examples"
    argv = ["simulate", "--plan", str(examples / "depths-plan.json"), "--cluster",
            str(examples / "two-speeds.toml"), "--wsp-staleness", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    wsp = json.loads(capsys.readouterr().out)["wsp"]
    waves = [w["alone_step_time_s"] for w in wsp["virtual_workers"]]
    assert len(waves) == 2 and waves[0] != waves[1]
    assert wsp["step_time_s"] == pytest.approx(_pace(waves, wsp["exchange_s"], 1), rel=1e-9)
