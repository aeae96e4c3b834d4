"""`plait simulate --wsp-staleness D`: each virtual worker's step time against the
closed form of the WSP replay (the slowest wave, or the slowest wave and the exchange
spread over D + 1 waves, whichever is longer) and its memory against the simulated
step's plus WSP's copies (a snapshot, D + 1 updates and D + 1 buffers of the weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.bench._fault_modes import SLOW_CLUSTER
from plait.cli.main import main

_CLUSTER = SLOW_CLUSTER  # one fast device and one 3× slower, as `bench faults` uses
_MODEL = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "32", "--dtype", "fp32"]


def _simulate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check_pace(wsp: dict) -> None:
    d, n, exchange = wsp["wsp_staleness"], wsp["wsp_wave"], wsp["exchange_s"]
    slowest = max(w["alone_step_time_s"] for w in wsp["virtual_workers"]) * n
    expected = max(slowest, (slowest + exchange) / (d + 1)) / n
    assert exchange > 0
    assert wsp["step_time_s"] == pytest.approx(expected)
    for w in wsp["virtual_workers"]:  # in the long run every worker keeps that pace
        assert w["step_time_s"] == pytest.approx(expected)


@pytest.mark.parametrize(("staleness", "wave"), [(0, 1), (2, 3)])
def test_replicas_keep_the_slowest_pace_and_hold_wsp_copies(
    staleness: int, wave: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(_CLUSTER)
    out = _simulate(["--cluster", str(cluster), "--dp", "2", "--pp", "1", "--microbatches",
                     "2", *_MODEL, "--wsp-staleness", str(staleness), "--wsp-wave", str(wave)],
                    capsys)  # fmt: skip
    wsp = out["wsp"]
    assert (wsp["wsp_staleness"], wsp["wsp_wave"]) == (staleness, wave)
    _check_pace(wsp)
    fast, slow = wsp["virtual_workers"]
    assert (fast["devices"], slow["devices"]) == (["fast"], ["slow"])
    assert fast["waiting_share"] > slow["waiting_share"] >= 0  # the slow one waits at most
    # for the exchange
    # memory: the (same) simulated step's, plus the fp32 weights (1 + 2(D + 1)) times
    step = out["memory"][0]
    for w in (fast, slow):
        assert w["wsp_extra_bytes"] == [pytest.approx(step["params"] * (3 + 2 * staleness))]
        assert w["peak_memory_bytes"] == [pytest.approx(step["total"] + w["wsp_extra_bytes"][0])]


def test_a_plan_files_pipelines_are_the_virtual_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(_CLUSTER)
    plan = {"dp": 2, "tp": 1, "pp": 1, "schedule": "1f1b", "microbatches": 2, "chunks": 1,
            "micro_batch_size": 1, "wsp_staleness": 1, "wsp_wave": 1,
            "pipelines": [{"partition": [4], "microbatches": 3},
                          {"partition": [4], "microbatches": 1}],
            "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32},
            "cluster": str(cluster), "dtype": "fp32"}  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    wsp = _simulate(["--plan", str(path)], capsys)["wsp"]
    workers = wsp["virtual_workers"]
    assert [w["microbatches"] for w in workers] == [3, 1]
    assert [w["partition"] for w in workers] == [[4], [4]]
    _check_pace(wsp)


def test_wsp_without_replicas_is_refused_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text(_CLUSTER)
    argv = ["simulate", "--cluster", str(cluster), "--pp", "1", *_MODEL, "--json"]
    for extra, message in (
        (["--dp", "1", "--wsp-staleness", "1"], "with dp=1"),
        (["--dp", "2", "--wsp-staleness", "-1"], "--wsp-staleness -1"),
    ):
        assert main([*argv, *extra]) != 0
        out = capsys.readouterr()
        assert message in out.err and out.out == ""
