"""The command line loads no torch until a command runs: `plait --help`, `plait COMMAND
--help` and `plait schedule ...` print as usual, and `python -X importtime` lists no torch
module for them (torch takes seconds to import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("train", "schedule", "bench", "checkpoint", "profile", "simulate", "plan",
            "experiment")  # fmt: skip


def _plait(*argv: str) -> tuple[str, list[str]]:
    """stdout of `python -X importtime -m plait ARGV`, and the modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "plait", *argv], env=env,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    # importtime writes "import time: self | cumulative | name" lines to stderr
    modules = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
               if line.startswith("import time:") and "|" in line]  # fmt: skip
    return done.stdout, modules


def _torch(modules: list[str]) -> list[str]:
    return [m for m in modules if m == "torch" or m.startswith("torch.")]


def test_help_imports_no_torch() -> None:
    out, modules = _plait("--help")
    assert "plait" in modules and "plait.cli.main" in modules  # the listing is read
    assert _torch(modules) == []
    assert out.startswith("usage: plait ")
    for command in COMMANDS:
        assert f"    {command}" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_imports_no_torch(command: str) -> None:
    out, modules = _plait(command, "--help")
    assert _torch(modules) == []
    assert out.startswith(f"usage: plait {command} ")


def test_schedule_imports_no_torch() -> None:
    out, modules = _plait("schedule", "1f1b", "--pp", "2", "--microbatches", "4")
    assert _torch(modules) == []
    # 1F1B on p = 2 stages, m = 4 micro-batches, forward 1 and backward 2 units: the
    # makespan is (m + p − 1) × 3 units and the bubble (p − 1) / (m + p − 1)
    assert out.rstrip().endswith(
        "1f1b: 2 ranks, 2 stages, 4 micro-batches; unit-cost makespan 15, bubble 20.0%, "
        "peak in-flight micro-batches per rank [2, 1]"
    )
    assert out.startswith("time ")


def test_a_bench_gets_its_flags_when_chosen() -> None:
    out, _ = _plait("bench", "planner", "--help")
    assert out.startswith("usage: plait bench planner ")
    assert "--workers" in out
