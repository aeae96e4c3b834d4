"""Two torchrun agents on this machine acting as two nodes (c10d rendezvous on loopback),
one worker each, a two-stage pipeline across them, started as docs/multi-node.md says
(`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`): a worker killed with SIGKILL is restarted by
torchrun (`--max-restarts 1`), every worker resumes from the newest checkpoint by itself,
and the run ends with the weights of an uninterrupted run, bit for bit; a whole node
killed (agent and worker) ends the other's run at once with one line naming the lost
rank and its node, and the checkpoints saved before stay."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plait.bench.faults import final_weights
from plait.checkpoint.store import published

pytestmark = pytest.mark.dist

SMALL = ["--pp", "2", "--timeout", "20", "--layers", "2", "--hidden", "16", "--heads", "2",
         "--seq-len", "16",
         "--batch-size", "8", "--sample-chars", "0", "--eval-batches", "0", "--log-every", "1",
         "--device", "cpu", "--checkpoint-every", "2", "-q"]  # fmt: skip
STEPS = 10


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agents(run_dir: Path, port: int, restarts: int) -> list[subprocess.Popen[str]]:
    """Node 0's agent hosts the rendezvous store (one machine: say which, as on two)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    agents = []
    for node in range(2):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--rdzv-id", f"plait-{port}", "--rdzv-conf",
                    f"is_host={int(node == 0)}", "--max-restarts", str(restarts)]  # fmt: skip
        cmd = [*torchrun, "-m", "plait.cli.main", "train", "--run-dir", str(run_dir),
               "--max-steps", str(STEPS), *SMALL]  # fmt: skip
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env, start_new_session=True))  # fmt: skip
        if node == 0:
            time.sleep(1.0)  # the host's store first
    return agents


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def _worker_of(agent: subprocess.Popen[str]) -> int:
    """The agent's training worker (its child that runs plait)."""
    for pid in _children(agent.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        if "plait" in cmdline:
            return pid
    raise AssertionError(f"agent {agent.pid} has no plait worker yet")


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _finish(agents: list[subprocess.Popen[str]], timeout: float = 240) -> list[tuple[str, str]]:
    """The agents' outputs; an agent still running after `timeout` is killed and the
    failure shows what every agent printed (an agent waits at its exit barrier for a node
    that failed: the cause is in the other one's output)."""
    deadline, outs = time.time() + timeout, []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=max(1.0, deadline - time.time())))
        return outs
    except subprocess.TimeoutExpired:
        for a in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
        outs += [a.communicate() for a in agents[len(outs) :]]
        raise AssertionError(f"an agent ran past {timeout} s; the agents printed: "
                             + " | ".join(err[-1500:] for _, err in outs)) from None  # fmt: skip
    finally:
        for a in agents:
            if a.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(a.pid, signal.SIGKILL)


def _after_a_checkpoint(agents: list[subprocess.Popen[str]], run_dir: Path) -> None:
    deadline = time.time() + 180
    while not (published(run_dir / "checkpoints") and _steps(run_dir) >= 5):
        assert all(a.poll() is None for a in agents), "the run ended before the fault"
        assert time.time() < deadline, "no checkpoint within 180 s"
        time.sleep(0.01)


def test_a_killed_worker_is_restarted_by_torchrun_and_ends_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    outs = _finish(_agents(reference, _port(), restarts=0))
    assert _steps(reference) == STEPS, outs
    run_dir = tmp_path / "killed"
    agents = _agents(run_dir, _port(), restarts=1)
    try:
        _after_a_checkpoint(agents, run_dir)
        os.kill(_worker_of(agents[1]), signal.SIGKILL)
    finally:
        outs = _finish(agents)
    assert [a.returncode for a in agents] == [0, 0], outs
    final, ref = final_weights(run_dir), final_weights(reference)
    assert final.keys() == ref.keys()
    for k in ref:
        assert torch.equal(final[k], ref[k]), k


def test_a_lost_node_ends_the_other_nodes_run_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "lost"
    agents = _agents(run_dir, _port(), restarts=0)
    try:
        _after_a_checkpoint(agents, run_dir)
        worker = _worker_of(agents[1])  # a session of its own: the node is both
        os.killpg(agents[1].pid, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        start = time.time()
        _, err = agents[0].communicate(timeout=120)
        took = time.time() - start
    finally:
        _finish(agents, timeout=5)
    assert agents[0].returncode != 0
    plait = [line for line in err.splitlines() if "plait train: error:" in line]
    assert len(plait) == 1, err[-3000:]
    # the surviving rank waited on its peer: the line names the lost rank and its node
    assert "rank 1 (node 1)" in plait[0] and "lost the connection" in plait[0], plait
    assert took < 60, took  # at once, not after --timeout and torchrun's own timeouts
    kept = published(run_dir / "checkpoints")
    assert kept, "the checkpoints saved before the loss are kept"
