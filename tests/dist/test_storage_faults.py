"""Hangs, as a user meets them running `plait train`: a worker stopped with SIGSTOP
(alive, silent) is reported within `--timeout` in one line naming the rank and what it
waited for."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.bench.faults import workers_of

pytestmark = pytest.mark.dist

SMALL = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16",
         "--batch-size", "8", "--sample-chars", "0", "--eval-batches", "0", "--log-every", "1",
         "--device", "cpu", "--nproc", "2", "--pp", "2"]  # fmt: skip


def _train(run_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "plait", "train", "--run-dir", str(run_dir), *SMALL, *flags]


def _start(run_dir: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _train(run_dir, *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )  # fmt: skip


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait(proc: subprocess.Popen[str], ready: object, what: str, limit: float = 120) -> None:
    deadline = time.time() + limit
    while not ready():  # type: ignore[operator]
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()}"  # type: ignore[union-attr]
        assert time.time() < deadline, f"no {what} within {limit} s"
        time.sleep(0.01)


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line.lower()]


def test_a_stopped_worker_is_reported_within_the_timeout(tmp_path: Path) -> None:
    run_dir = tmp_path / "stopped"
    proc = _start(run_dir, "--max-steps", "100000", "--timeout", "8")
    stopped = None
    try:
        _wait(proc, lambda: _steps(run_dir) >= 2, "two steps")
        stopped = workers_of(proc.pid)[-1]
        os.kill(stopped, signal.SIGSTOP)
        start = time.time()
        _, err = proc.communicate(timeout=150)
        took = time.time() - start
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    errors = _errors(err)
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "rank" in errors[0] and ("timed out" in errors[0] or "timeout" in errors[0]), errors
    # the waiting rank gives up after --timeout; the launcher then ends the stopped one
    assert took < 8 + 60, took
