"""`plait bench sim-accuracy` end to end on a 2-plan grid: workers run, predictions compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.main import main

pytestmark = pytest.mark.dist


def test_sim_accuracy_runs_a_small_grid(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        ["bench", "sim-accuracy", "--worlds", "2", "--schedules", "1f1b", "--microbatches", "2,4",
         "--steps", "2", "--warmup", "1", "--rounds", "2", "--layers", "2", "--hidden", "32", "--seq-len", "16",
         "--micro-batch-size", "2", "--profile-repeats", "2", "--trace-dir", str(tmp_path),
         "--json"]
    )  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"median_abs_error", "max_abs_error", "plans", "calibration"} <= set(data)
    plans = data["plans"]
    assert [p["plan"] for p in plans] == ["1f1b pp=2 m=2", "1f1b pp=2 m=4"]
    for p in plans:
        assert p["predicted_s"] > 0 and p["measured_s"] > 0
        assert p["error"] == pytest.approx((p["predicted_s"] - p["measured_s"]) / p["measured_s"])
    assert data["max_abs_error"] == pytest.approx(max(abs(p["error"]) for p in plans))
    calibration = data["calibration"]["1f1b pp=2 m=4"]
    assert len(calibration["blocks"]) == 4
    assert calibration["flops"] > 0 and min(calibration["message_overheads"]) > 0
    link = calibration["link"]
    assert link["bandwidth_Bps"] > 0 and link["latency_s"] >= 0
    traces = sorted(p.name for p in tmp_path.glob("*.json"))
    assert traces == ["1f1b_pp2_m2.json", "1f1b_pp2_m4.json"]
    events = json.loads((tmp_path / traces[0]).read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 1000, 1001}
