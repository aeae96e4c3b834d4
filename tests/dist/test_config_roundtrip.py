"""A run's config.json is the configuration that ran: passed back with --config it trains
the same run again, bit for bit, even when the first run planned its own layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.config.sections import from_file
from plait.cli.main import main

pytestmark = pytest.mark.dist

SMALL = ["--layers", "2", "--hidden", "64", "--seq-len", "32", "--batch-size", "16",
         "--sample-chars", "0"]  # fmt: skip


def _steps(run_dir: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows]


def test_config_json_reproduces_an_auto_planned_run(tmp_path: Path) -> None:
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["train", "--nproc", "2", "--max-steps", "3", "--run-dir", str(first), *SMALL]) == 0
    saved = json.loads((first / "config.json").read_text())
    summary = json.loads((first / "summary.json").read_text())
    assert summary["plan_source"] == "auto"
    # the layout that ran, not the one before planning; no plan left to redo
    assert saved["plan"] is None
    layout, _ = from_file(saved)  # the plan's fields, from their sections
    assert "parallel" not in saved and saved["layout"]["pp"] == layout["pp"]
    assert {k: layout[k] for k in summary["plan"]} == summary["plan"]
    code = main(["train", "--config", str(first / "config.json"), "--run-dir", str(again)])
    assert code == 0
    assert len(_steps(first)) == 3
    assert _steps(again) == _steps(first)  # exactly: same layout, seed and data
    resaved = json.loads((again / "config.json").read_text())
    assert {**resaved, "run_dir": None} == {**saved, "run_dir": None}
