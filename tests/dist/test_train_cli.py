"""`plait train` end to end: workers launched, run folder written, the loss falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.main import main

pytestmark = pytest.mark.dist


def test_train_writes_the_run_folder_and_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--max-steps",
            "40",
            "--run-dir",
            str(run_dir),
            "--layers",
            "2",
            "--hidden",
            "64",
            "--seq-len",
            "32",
            "--batch-size",
            "16",
            "--sample-chars",
            "20",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(40))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan"]["pp"] == 2 and summary["step_time_s"] > 0
    assert 0.0 <= summary["bubble_fraction"] < 1.0
    timeline = json.loads((run_dir / "timeline.json").read_text())
    assert len(timeline) == 2 and {r["label"] for r in timeline[1]} >= {"1F0", "1B0"}
    assert json.loads((run_dir / "schedule.json").read_text())["kind"] == "1f1b"
    assert json.loads((run_dir / "config.json").read_text())["max_steps"] == 40


def test_bad_flags_fail_before_any_worker_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--nproc", "2", "--pp", "3"]) == 2
    assert "nproc=2 workers but dp × tp × pp = 1 × 1 × 3 = 3" in capsys.readouterr().err
