"""What `plait train` prints when piped: under -q only the final summary, by default the
chosen layout before the first step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch-size",
        "4", "--max-steps", "2", "--nproc", "1", "--eval-batches", "0"]  # fmt: skip


def _train(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`plait train` in a subprocess, its output piped (workers' lines included)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "plait", "train", *TINY, "--run-dir", str(tmp_path / "run")]
    done = subprocess.run([*argv, *flags], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_quiet_prints_the_summary_and_warnings_only(tmp_path: Path) -> None:
    done = _train(tmp_path, "-q", "--pp", "1", "--microbatches", "1")
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3, done.stdout
    assert lines[0].startswith("plan (as given): dp=1, tp=1, pp=1, schedule=1f1b")
    assert lines[1].startswith("loss ") and " tok/s " in lines[1]
    assert lines[2].startswith(f"run folder: {tmp_path / 'run'} ")
    assert all("warning" in line.lower() for line in done.stderr.splitlines()), done.stderr


def test_the_chosen_layout_is_printed_before_the_first_step(tmp_path: Path) -> None:
    lines = _train(tmp_path).stdout.splitlines()  # no layout given: planned on the worker
    layout = next(i for i, x in enumerate(lines) if x.startswith("layout (planned on the"))
    first = next(i for i, x in enumerate(lines) if x.startswith("step 0 (1/2)"))
    assert layout < first, lines
    assert "dp=1, tp=1, pp=1, schedule=" in lines[layout], lines[layout]
