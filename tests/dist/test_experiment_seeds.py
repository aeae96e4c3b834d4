"""`plait experiment dp-vs-gpipe`, `data-movement` and `all` end to end on tiny settings (one
epoch of one batch, one timed step): the JSON contract, the measured cells, and a resumed
`all` that measures nothing again and writes the whole report (every section, the
plots, one JSON with every number). The worlds are launched once each, by the first two
commands; `all` reuses their cells from the same folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait.cli.main import main

pytestmark = pytest.mark.dist

DP = ["--workers", "2", "--epochs", "1", "--images", "16", "--width", "4", "--dtype", "fp32"]
DM = ["--batch-size", "4", "--image-size", "32", "--steps", "1"]
DM_MODELS = "mobilenet_v2"
DM_WORKERS = "1,2"


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # --json prints exactly one line
    out: dict[str, Any] = json.loads(lines[0])
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("seeds")


def test_dp_vs_gpipe_measures_both_ways_and_predicts_the_paper(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _json(capsys, ["experiment", "dp-vs-gpipe", *DP, "--out", str(folder), "--json",
                            "--quiet"])  # fmt: skip
    assert set(result["measured"]) == {"ddp/2/fp32", "gpipe/2/fp32"}
    for cell in result["measured"].values():
        assert cell["seconds"] > 0 and cell["steps"] == 1
        assert 0 <= cell["accuracy"] <= 100
    assert sum(result["measured"]["gpipe/2/fp32"]["partition"]) == 10  # ResNet-18's blocks
    tables = result["predicted"]["tables"]
    assert set(tables) == {"fp32", "fp16"}
    for table in tables.values():
        assert [r["gpus"] for r in table["rows"]] == [2, 4, 6, 8]
        for row in table["rows"]:
            for method in ("ddp", "gpipe"):
                cell = row[method]
                assert cell["seconds"] > 0 and cell["bound"] in ("gpu", "input", "host")
                assert cell["error"] == pytest.approx(
                    abs(cell["seconds"] - cell["published_s"]) / cell["published_s"]
                )
            assert set(row["plait"]) == {"1f1b", "interleaved", "planner"}
        assert set(table["median_error"]) == {"ddp", "gpipe"}
    findings = result["predicted"]["findings"]
    assert [f.split(":")[0] for f in findings[:4]] == [f"{g} GPUs" for g in (2, 4, 6, 8)]
    assert "host time per (micro-batch, stage) task" in findings[4]


def test_data_movement_measures_baseline_and_remedies(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["experiment", "data-movement", "--models", DM_MODELS, "--workers", DM_WORKERS, *DM,
            "--out", str(folder), "--json", "--quiet"]  # fmt: skip
    result = _json(capsys, argv)
    assert set(result["measured"]) == {f"{DM_MODELS}/1", f"{DM_MODELS}/2"}
    for key, cell in result["measured"].items():
        for variant in ("base", "remedy"):
            shares = cell[variant]
            assert 0 <= shares["I"] <= 100 and 0 <= shares["M"] <= 100 and shares["step_s"] > 0
            assert shares["replicas_agree"]  # the averaged gradients reached the optimizer
            if key.endswith("/1"):
                assert shares["M"] == 0  # one worker reduces nothing
    rows = result["predicted"]["rows"]
    assert [(r["model"], r["gpus"]) for r in rows] == [(DM_MODELS, g) for g in (1, 2, 3, 4)]
    assert result["predicted"]["median_error"] is not None


def test_all_resumes_and_writes_every_table_plot_and_number(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import plait.experiment.data_movement as dm
    import plait.experiment.dp_vs_gpipe as dg

    def measured_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cell already in results.json was measured again")

    monkeypatch.setattr(dg, "measure_cell", measured_again)
    monkeypatch.setattr(dm, "measure_cell", measured_again)
    movement = ["--movement-models", DM_MODELS, "--movement-workers", DM_WORKERS,
                *(f"--movement-{a[2:]}" if a.startswith("--") else a for a in DM)]  # fmt: skip
    argv = ["experiment", "all", "--out", str(folder), *DP, *movement, "--quiet",
            "--staleness-stages", "1,2", "--staleness-schedules", "1f1b", "--staleness-budget",
            "8"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    data = json.loads((folder / "results.json").read_text())
    assert {"dp_vs_gpipe", "data_movement", "staleness"} <= set(data)
    assert len(data["staleness"]["runs"]) == 2
    report = (folder / "report.md").read_text()
    for heading in ("## Data parallelism vs GPipe", "### Predicted, fp32", "### Predicted, fp16",
                    "## Data movement", "## Staleness", "## Plots"):  # fmt: skip
        assert heading in report
    assert report.count("### Measured here") == 2
    for png in ("dp_vs_gpipe.png", "data_movement.png", "staleness.png"):
        assert (folder / png).read_bytes()[:4] == b"\x89PNG"
        assert f"]({png})" in report
