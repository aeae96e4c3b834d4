"""Losing a worker, and stopping a run: `plait train` as a user runs it, in a subprocess.

A worker killed with SIGKILL after the first checkpoint is restarted (`--max-restarts 1`)
and the run ends with weights equal bit for bit to an uninterrupted run's; without
restarts the run ends with one line naming the rank and the signal; Ctrl-C stops every
worker and leaves the published checkpoints whole, and prints one line, with the command
that resumes, also while the workers start. Local launches listen on loopback only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plait.bench.faults import FaultsConfig, final_weights, train_command, workers_of
from plait.checkpoint.store import published, verify
from plait.cli.main import main
from plait.train.launch import launch

pytestmark = pytest.mark.dist

CONFIG = FaultsConfig(trials=1, steps=16, every=4)


def _start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        train_command(run_dir, CONFIG, *extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group: a Ctrl-C reaches it and its workers only
    )


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            break
    return steps


def _after_first_checkpoint(proc: subprocess.Popen[str], run_dir: Path) -> int:
    """Wait until a checkpoint is published and two more steps have run; that step count."""
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, "the run ended before the fault was injected"
        assert time.time() < deadline, "no checkpoint within 120 s"
        found = published(run_dir / "checkpoints")
        if found and len(_steps(run_dir)) >= int(found[0].name[5:]) + 2:
            return len(_steps(run_dir))
        time.sleep(0.002)


def _kill_one_worker(proc: subprocess.Popen[str]) -> int:
    workers = workers_of(proc.pid)
    assert len(workers) == CONFIG.nproc, workers
    os.kill(workers[-1], signal.SIGKILL)
    return workers[-1]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    # the uninterrupted run in this process: its weights are what is compared
    command = train_command(reference, CONFIG)
    assert command[1:3] == ["-m", "plait.cli.main"], command
    assert main(command[3:]) == 0
    run_dir = tmp_path / "killed"
    proc = _start(run_dir, "--max-restarts", "1")
    _after_first_checkpoint(proc, run_dir)
    _kill_one_worker(proc)
    # counted once the kill has landed: the run may publish a newer checkpoint between the
    # count above and the kill, and nothing after the kill (a save needs every rank)
    done = len(_steps(run_dir))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    restarts = [line for line in err.splitlines() if "restart 1 of 1" in line]
    assert len(restarts) == 1, err
    line = restarts[0]
    assert line.startswith("plait train: rank ") and "failed (SIGKILL)" in line, line
    resumed = int(line.rsplit("resuming from step ", 1)[1])
    assert 0 < resumed <= done and resumed % CONFIG.every == 0, (resumed, done)
    assert "Traceback" not in err and "torch/distributed/elastic" not in err, err
    assert _steps(run_dir) == list(range(CONFIG.steps))  # every step once, the rerun ones too
    _equal(final_weights(run_dir), final_weights(reference))


def test_without_restarts_a_lost_worker_ends_the_run_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "lost"
    proc = _start(run_dir)
    _after_first_checkpoint(proc, run_dir)
    _kill_one_worker(proc)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, err
    assert errors[0].startswith("plait train: error: rank ") and "(SIGKILL)" in errors[0], err
    assert "Traceback" not in err, err
    kept = published(run_dir / "checkpoints")
    assert kept and verify(kept[0]) is None  # what was saved is whole


def test_ctrl_c_stops_every_worker_and_keeps_the_checkpoints(tmp_path: Path) -> None:
    run_dir = tmp_path / "stopped"
    proc = _start(run_dir)
    _after_first_checkpoint(proc, run_dir)
    workers = workers_of(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    last = err.strip().splitlines()[-1]
    newest = published(run_dir / "checkpoints")
    assert newest and verify(newest[0]) is None
    assert last == (
        f"plait train: stopped by SIGINT; workers stopped; newest checkpoint {newest[0]}; "
        f"resume: plait train --config {run_dir / 'config.json'} --resume auto"
    ), err
    assert "Traceback" not in err, err
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"worker {pid} still runs"


def test_ctrl_c_while_the_workers_start_prints_one_line(tmp_path: Path) -> None:
    """The workers import torch for seconds after they are spawned: a Ctrl-C then ends the
    run with the launcher's one line, no worker's KeyboardInterrupt traceback."""
    run_dir = tmp_path / "starting"
    proc = _start(run_dir)
    deadline = time.time() + 120
    while not workers_of(proc.pid):
        assert proc.poll() is None and time.time() < deadline, "no worker was spawned"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert err.strip().splitlines() == [
        "plait train: stopped by SIGINT; workers stopped; no checkpoint published yet; run "
        f"again: plait train --config {run_dir / 'config.json'} --resume auto"
    ], err


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ------------------------------------------------------------------ loopback only
def _listening(pids: set[int]) -> list[str]:
    """The local addresses of the TCP sockets in LISTEN state that `pids` hold open."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(_address(cols[1], family))
    return found


def _address(hex_addr: str, family: int) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if family == socket.AF_INET:
        raw = raw[::-1]
    else:  # four little-endian 32-bit words
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"


def _report_listeners() -> list[str]:
    import torch.distributed as dist

    from plait.mesh import init_worker

    init_worker(timeout_s=60)
    dist.barrier()  # every connection made
    pids = {os.getpid(), os.getppid()}
    if dist.get_rank() == 0:
        pids |= set(workers_of(os.getppid()))
    found = _listening(pids) if dist.get_rank() == 0 else []
    dist.barrier()
    dist.destroy_process_group()
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_local_launch_listens_on_loopback_only() -> None:
    found = launch(_report_listeners, 2)[0]
    assert found, "the workers' sockets were not seen"
    strays = [a for a in found if not a.startswith(("127.", "::1:", "::ffff:127."))]
    assert not strays, f"listening beyond loopback: {strays} (all: {found})"
