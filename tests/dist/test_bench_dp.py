"""`plait bench dp` runs plait, DDP and FSDP2 to the same loss and reports positive times."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.bench.dp import RUNTIMES, DPBenchConfig
from plait.cli.main import main

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8"]
KEYS = {
    "plait_step_s", "ddp_step_s", "fsdp_step_s", "ratio_vs_ddp", "ratio_vs_fsdp", "steps",
    "workers", "num_params", "model", "plait_loss", "ddp_loss", "fsdp_loss", "loss_match",
    "grad_match",
}  # fmt: skip


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_bench_runs_three_runtimes_to_the_same_loss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dp", "--warmup", "1", "--steps", "2", "--json", *TINY]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line, got {lines}"
    report = json.loads(lines[0])
    assert set(report) >= KEYS, f"missing keys {sorted(KEYS - set(report))}"
    assert (report["workers"], report["steps"], report["model"]["num_layers"]) == (2, 2, 2)
    assert report["num_params"] > 0
    for name in RUNTIMES:
        assert len(report[f"{name}_times_s"]) == 2
        assert all(t > 0 for t in report[f"{name}_times_s"]) and report[f"{name}_step_s"] > 0
    assert report["ratio_vs_ddp"] > 0 and report["ratio_vs_fsdp"] > 0
    losses = {name: report[f"{name}_loss"] for name in RUNTIMES}
    assert report["loss_match"] is True, losses
    assert report["grad_match"] is True, report["grad_max_diff"]


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"batch_size": 15}, "batch_size=15 is not divisible by num_workers=2"),
        ({"optimizer": "lamb"}, "choose one of"),
        ({"num_steps": 0}, "num_steps=0 must be >= 1"),
        ({"hidden": 30, "num_heads": 4}, "not divisible by num_heads"),
    ],
)
def test_bad_input_is_refused_before_workers_start(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        DPBenchConfig(**fields)
