"""`plait bench async`: the JSON contract, and weight versions measured by the runtime's
weight store equal to the closed forms of each schedule (PipeDream stage s holds p - s
versions, 2BW two)."""

from __future__ import annotations

import json

import pytest

from plait.bench.asynchronous import AsyncBenchConfig
from plait.cli.main import main
from plait.schedule import KINDS

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8"]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bench_reports_throughput_and_measured_versions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "async", "--pp", "2", "--microbatches", "4", "--steps", "2"]
    argv += ["--rounds", "1", "--warmup", "1", "--json", *TINY]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line, got {lines}"
    report = json.loads(lines[0])
    assert (report["stages"], report["microbatches"]) == (2, 4)
    assert set(report["schedules"]) == {"1f1b", "pipedream", "2bw"}
    for kind, row in report["schedules"].items():
        assert set(row) >= {"samples_per_s", "peak_weight_versions", "speedup_vs_1f1b"}
        assert row["samples_per_s"] > 0
        expected = [KINDS[kind].versions(2, 4, s) for s in range(2)]
        assert row["peak_weight_versions"] == expected, kind
    assert report["schedules"]["1f1b"]["speedup_vs_1f1b"] == 1.0


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"schedules": ("pipedream", "2bw")}, "include 1f1b"),
        ({"schedules": ("1f1b", "dualpipe")}, "'dualpipe' is unknown"),
        ({"batch_size": 10}, "batch_size=10 is not divisible"),
        ({"schedules": ("1f1b", "2bw"), "num_stages": 5, "num_layers": 2}, "num_layers=2"),
    ],
)
def test_bad_input_is_refused_before_workers_start(
    fields: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        AsyncBenchConfig(**fields)  # type: ignore[arg-type]
