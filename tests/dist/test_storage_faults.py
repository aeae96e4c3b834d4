"""Hangs and storage faults, as a user meets them running `plait train`.

A worker stopped with SIGSTOP (alive, silent) is reported within `--timeout` in one line
naming the rank and what it waited for. A checkpoint saved onto a full disk (a tmpfs
filled, once the first checkpoint is out, to less than a checkpoint's room) or into a
checkpoints folder turned read-only (a read-only bind mount) ends the run with one line
naming the cause and the step (docs/checkpoints.md), and the checkpoint published before
stays whole: it verifies, `plait checkpoint inspect` reads it and a run resumes from it.
The disk faults mount, so they need root (they skip otherwise, saying so).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait.bench.faults import workers_of
from plait.checkpoint.store import published, verify

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
    # the waiting rank gives up after --timeout; the launcher then ends the stopped one at
    # once (continued, so that torch's SIGTERM lands), not after torch's 30 s before SIGKILL
    assert took < 8 + 25, took


def _mount(*args: str) -> None:
    out = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if out.returncode:
        pytest.skip(f"cannot mount here (needs root): mount {' '.join(args)}: {out.stderr}")


def _remount_read_only(folder: Path) -> None:
    """Turn `folder`'s bind mount read-only; the kernel refuses ("busy") while the run has
    a file open for writing there (a save every 2 steps), so it is tried until a moment
    between writes."""
    deadline = time.time() + 30
    while True:
        out = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)],
                             capture_output=True, text=True, check=False)  # fmt: skip
        if out.returncode == 0:
            return
        if "busy" not in out.stderr:
            pytest.skip(f"cannot remount read-only here (needs root): {out.stderr}")
        assert time.time() < deadline, f"the mount stayed busy for 30 s: {out.stderr}"
        time.sleep(0.01)


@contextlib.contextmanager
def _mounted(path: Path, *args: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    _mount(*args, str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Fill `disk` until `leave` bytes are free (less than a checkpoint, more than the
    metrics rows the run writes meanwhile)."""
    with (disk / "filler").open("wb", buffering=0) as f:
        # the run writes meanwhile (a save in flight): fill by what is free at each chunk,
        # and give back what it took if the disk filled before `leave` was reached
        while (free := shutil.disk_usage(disk).free - leave) > 0:
            try:
                f.write(b"\0" * min(free, 1 << 20))
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                break
        short = leave - shutil.disk_usage(disk).free
        if short > 0:
            f.truncate(max(0, os.fstat(f.fileno()).st_size - short))


def _until_a_save_fails(run_dir: Path, fault: object) -> str:
    """Train until a checkpoint is published, cause `fault`, and return the stderr of
    the run, which must end by itself."""
    proc = _start(run_dir, "--max-steps", "100000", "--checkpoint-every", "2", "--keep", "5")
    try:
        _wait(proc, lambda: bool(published(run_dir / "checkpoints")), "a checkpoint")
        fault()  # type: ignore[operator]
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    return err


def _kept_whole(run_dir: Path, tmp_path: Path, *, resume: bool) -> None:
    """The checkpoint published before the fault verifies, reads, and (`resume`) a run
    resumes from a copy of it."""
    kept = published(run_dir / "checkpoints")
    assert kept and verify(kept[0]) is None, kept
    inspect = [sys.executable, "-m", "plait", "checkpoint", "inspect", str(kept[0])]
    out = subprocess.run(inspect, capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0 and "verified    OK" in out.stdout, out.stdout + out.stderr
    if not resume:
        return
    again = tmp_path / "again"
    shutil.copytree(kept[0], again / "checkpoints" / kept[0].name)
    step = int(kept[0].name.removeprefix("step-"))
    out = subprocess.run(_train(again, "--max-steps", str(step + 1), "--resume", "auto", "-q"),
                         capture_output=True, text=True, check=False, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"resuming from step {step}" in out.stderr, out.stderr


def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_checkpoint_before(
    tmp_path: Path,
) -> None:
    with _mounted(tmp_path / "disk", "-t", "tmpfs", "-o", "size=32m", "tmpfs") as disk:
        run_dir = disk / "run"
        err = _until_a_save_fails(run_dir, lambda: _fill(disk, 256 * 1024))
        errors = _errors(err)
        assert len(errors) == 1 and "Traceback" not in err, err
        line = errors[0]
        assert "No space left on device while saving step" in line, line
        assert str(run_dir / "checkpoints") in line and "--keep" in line, line
        (disk / "filler").unlink()  # room again: the kept checkpoint is read from here
        _kept_whole(run_dir, tmp_path, resume=True)


def test_a_checkpoints_folder_turned_read_only_stops_the_run_in_one_line(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    with _mounted(folder, "--bind", str(tmp_path / "run" / "checkpoints")):
        err = _until_a_save_fails(run_dir, lambda: _remount_read_only(folder))
        errors = _errors(err)
        assert len(errors) == 1 and "Traceback" not in err, err
        assert "Read-only file system while saving step" in errors[0], errors
        assert "--run-dir" in errors[0], errors
        _kept_whole(run_dir, tmp_path, resume=False)
