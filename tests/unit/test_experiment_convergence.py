"""`plait experiment convergence`: a tiny run writes the report, its plots and its JSON,
and a second run with the same settings keeps what the first measured; the issue's checks
read epochs as their definitions say (within 2× of the synchronous epochs; the share of
PipeDream's extra epochs that prediction recovers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait.cli.main import main
from plait.experiment.convergence_report import checks


def test_a_tiny_run_writes_the_report_and_resumes(tmp_path: Path, capsys: Any) -> None:
    argv = ["experiment", "convergence", "--out", str(tmp_path), "--quick", "--sections",
            "image,gpt"]  # fmt: skip
    assert main(argv) == 0
    report = (tmp_path / "convergence.md").read_text()
    assert "## Stale pipelines, the papers' regime" in report and "Checks:" in report
    assert "52 epochs" in report  # the seed's figure beside plait's
    data = json.loads((tmp_path / "convergence.json").read_text())
    assert set(data) == {"image", "gpt"}
    assert data["image"]["main"]["metric"] == "val_accuracy"
    assert set(data["image"]["remedies"]) == {"lr-warmup", "staleness-lr"}
    if pytest.importorskip("matplotlib"):
        assert (tmp_path / "convergence-image-epochs.png").stat().st_size > 0
        assert (tmp_path / "convergence-gpt-time.png").stat().st_size > 0
    capsys.readouterr()
    assert main(argv) == 0
    assert "image: kept" in capsys.readouterr().err


def _run(kind: str, epochs: float | None, budget: float) -> dict[str, Any]:
    return {"schedule": kind, "stages": 4, "epochs_to_target": epochs, "best_val_loss": 3.1,
            "curve": [{"epochs": 0.0}, {"epochs": budget}]}  # fmt: skip


def _result(budget: float = 10.0, **epochs: float | None) -> dict[str, Any]:
    runs = [_run(k, e, budget) for k, e in epochs.items()]
    config = {"stages": [1, 4], "schedules": list(epochs)}
    main = {"runs": runs, "config": config, "metric": "val_loss", "target": 2.5}
    return {"main": main, "remedies": {}}


def test_the_checks_follow_their_definitions() -> None:
    said = checks("image", _result(**{"1f1b": 2.0, "pipedream": 3.5, "spectrain": 2.6,
                                      "xpipe": 3.2}))  # fmt: skip
    assert "3.50 epochs against the synchronous 2.00 (1.75×): within 2× holds" in said[0]
    assert "60% of PipeDream's extra epochs recovered (holds)" in said[1]  # (3.5-2.6)/1.5
    assert "20% of PipeDream's extra epochs recovered (**fails**)" in said[2]  # (3.5-3.2)/1.5
    late = checks("image", _result(**{"1f1b": 2.0, "pipedream": 4.5, "spectrain": None}))
    assert "(2.25×): within 2× **fails**" in late[0] and "recovers none" in late[1]
    # a PipeDream run that misses the target fails 2× only where the budget covers 2×
    missed = checks("gpt", _result(5.0, **{"1f1b": 2.0, "pipedream": None, "xpipe": None}))
    assert "best loss 3.100 against 2.500" in missed[0] and "(**fails**)" in missed[0]
    assert "neither it nor PipeDream reached the target in the budget (best loss 3.100" in missed[1]
    short = checks("gpt", _result(3.0, **{"1f1b": 2.0, "pipedream": None}))
    assert "the budget is 1.50× that" in short[0] and "(**not shown**)" in short[0]


def test_unknown_sections_are_refused(capsys: Any) -> None:
    assert main(["experiment", "convergence", "--out", "x", "--sections", "image,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sections" in err
