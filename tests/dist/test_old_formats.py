"""Files written before the sectioned config and the named-axis layout still load: a run's
`config.json`, its `plan.json`, and a checkpoint (tests/golden/v1_run, written at a3456d9
by `plait train --nproc 2 --dp 1 --pp 2 --layers 2 --hidden 16 --heads 2 --seq-len 16
--batch-size 4 --max-steps 2 --checkpoint-every 2`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plait.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests" / "golden" / "v1_run"


def test_old_config_json_loads() -> None:
    from plait.config import load_config

    config = load_config(OLD / "config.json")
    raw = json.loads((OLD / "config.json").read_text())
    assert config.max_steps == raw["max_steps"] and config.batch_size == raw["batch_size"]
    assert config.model.layers == raw["model"]["layers"]
    assert config.model.hidden == raw["model"]["hidden"]
    for key in ("dp", "tp", "pp", "schedule", "microbatches", "zero", "recompute", "dtype"):
        assert getattr(config.parallel, key) == raw["parallel"][key], key


def test_old_checkpoint_resumes_with_old_config_and_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(OLD / "checkpoints", run / "checkpoints")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # `plait train` in this process: the files are what is checked, not the command's start-up
    argv = ["train", "--config", str(OLD / "config.json"), "--run-dir", str(run),
            "--resume", "auto", "--max-steps", "3", "--device", "cpu", "-q"]  # fmt: skip
    assert main(argv) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [s["step"] for s in steps if "step" in s and "loss" in s]
    assert trained == [2], trained  # steps count from 0: the third step only
    written = json.loads((run / "plan.json").read_text())  # in today's format: sections
    assert written["layout"]["pp"] == 2 and "dp" not in written
    # the plan file of the old run still drives a run
    plan = tmp_path / "plan.json"
    shutil.copy(OLD / "plan.json", plan)
    argv = [
        "train",
        "--plan",
        str(plan),
        "--max-steps",
        "1",
        "--layers",
        "2",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--run-dir",
        str(tmp_path / "again"),
        "--device",
        "cpu",
        "-q",
    ]
    assert main(argv) == 0
