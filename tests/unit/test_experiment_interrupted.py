"""A results folder holding an unfinished experiment (stopped with Ctrl-C) still renders:
the finished sections in full, the unfinished one named with how to finish it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.experiment import dp_vs_gpipe as dg
from plait.experiment.report import Store


def test_another_experiment_renders_beside_an_interrupted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # what `plait experiment dp-vs-gpipe --out DIR` leaves when stopped after one cell:
    # the section's config and that cell, no prediction (written only at the end)
    store = Store(tmp_path / "results.json")
    _, save = store.resume("dp_vs_gpipe", dg.DpGpipeConfig())
    cell = {"seconds": 1.5, "accuracy": 3.0, "final_loss": 4.25, "partition": None}
    save("ddp/2/fp32", cell)
    argv = ["experiment", "data-movement", "--predict-only", "--models", "resnet34",
            "--out", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0  # was: KeyError: 'predicted'
    report = (tmp_path / "report.md").read_text()
    assert "## Data movement in data parallelism (seed 003, Table 2)" in report
    assert "## Data parallelism vs GPipe: incomplete" in report
    assert "the 1 cell(s) measured so far" in report
    assert "`plait experiment dp-vs-gpipe --out DIR` again" in report
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["dp_vs_gpipe"]["measured"] == {"ddp/2/fp32": cell}  # kept for the resume
    assert "predicted" in saved["data_movement"]
    assert json.loads(capsys.readouterr().out)["config"]["models"] == ["resnet34"]
