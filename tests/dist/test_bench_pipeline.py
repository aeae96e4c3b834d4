"""`plait bench pipeline` runs both runtimes to the same loss and reports positive times."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.bench.pipeline_config import PipelineBenchConfig
from plait.cli.main import main

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8"]
KEYS = {
    "plait_step_s", "torch_step_s", "ratio", "schedule", "stages", "microbatches", "chunks",
    "steps", "plait_loss", "torch_loss", "loss_match", "plait_cpu_s", "torch_cpu_s",
}  # fmt: skip
# torch's interleaved 1F1B runs m // stages rounds and needs m to be a multiple of them
INTERLEAVED_9_ON_4 = {"schedule": "interleaved", "num_chunks": 2, "num_stages": 4,
                      "num_microbatches": 9, "num_layers": 10, "batch_size": 18}  # fmt: skip


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_bench_runs_both_runtimes_to_the_same_loss(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "pipeline", "--schedule", "interleaved", "--pp", "2"]
    argv += ["--microbatches", "4", "--warmup", "1", "--steps", "2", "--json", *TINY]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line, got {lines}"
    report = json.loads(lines[0])
    assert set(report) >= KEYS, f"missing keys {sorted(KEYS - set(report))}"
    assert (report["schedule"], report["stages"], report["chunks"]) == ("interleaved", 2, 2)
    assert (report["microbatches"], report["steps"]) == (4, 2)
    assert len(report["plait_times_s"]) == len(report["torch_times_s"]) == 2
    assert all(t > 0 for t in report["plait_times_s"] + report["torch_times_s"])
    assert report["plait_step_s"] > 0 and report["torch_step_s"] > 0 and report["ratio"] > 0
    assert report["loss_match"] is True, (report["plait_loss"], report["torch_loss"])
    assert report["grad_match"] is True, report["grad_max_diff"]


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"schedule": "zb-h2"}, "choose one of"),
        ({"schedule": "interleaved", "num_chunks": 2, "num_layers": 1}, "num_layers >= 2"),
        ({"schedule": "1f1b", "num_stages": 4, "num_microbatches": 2}, "at least 4 micro-batches"),
        (INTERLEAVED_9_ON_4, "not a multiple of 2 rounds"),
        ({"batch_size": 12}, "batch_size=12 is not divisible"),
        ({"schedule": "gpipe", "num_chunks": 2}, r"applies only to \[.interleaved., .zb-v.\]"),
    ],
)
def test_bad_input_is_refused_before_workers_start(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        PipelineBenchConfig(**fields)
