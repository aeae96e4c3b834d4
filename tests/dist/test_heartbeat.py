"""A rank whose collective ends on a broken connection names the rank that is gone: the
one whose heartbeat stood still, not a survivor that also failed and left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.dist.harness import start_world

from plait import heartbeat
from plait.wait import timed_wait, timeout_message

pytestmark = pytest.mark.dist


def _lose_rank_1(rank: int, world: int, folder: str, what: str) -> None:
    store = dist.FileStore(os.path.join(folder, "beats"), world)
    heartbeat.start(store, rank, world, interval_s=0.1)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # rank 1 is gone before the others reach the collective
    try:
        if what == "collective":
            dist.all_reduce(torch.ones(4))
        elif what == "timed collective":  # as the loss exchange waits: names no peer
            work = dist.all_reduce(torch.ones(4), async_op=True)
            timed_wait(work, 30.0, lambda: timeout_message(
                f"rank {rank}", "the loss exchange of window 5", 30.0,
                "the all-reduce of the losses over every rank", peers=world - 1))  # fmt: skip
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save({"w": torch.ones(4) * rank}, checkpoint_id=os.path.join(folder, "ck"))
        said = "(no error)"
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        said = heartbeat.explain_lost(str(error).strip().splitlines()[0][:400])
    Path(folder, f"rank{rank}.txt").write_text(said)
    os._exit(0)  # the group cannot be left cleanly with a peer gone


@pytest.mark.parametrize("what", ["collective", "timed collective", "checkpoint save"])
def test_the_survivors_of_a_lost_rank_name_it(tmp_path: Path, what: str) -> None:
    world = 3
    context = start_world(tmp_path, world, _lose_rank_1, str(tmp_path), what)
    for rank in (0, 2):
        context.processes[rank].join(timeout=90)
        assert context.processes[rank].exitcode == 0, (rank, context.processes[rank].exitcode)
    for rank in (0, 2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        if what == "timed collective":  # the wait's own words, and the rank gone
            assert said.startswith(f"rank {rank}: the loss exchange of window 5 lost the "
                                   "connection to rank 1 while waiting for the all-reduce"), (
                rank, said)  # fmt: skip
        else:
            assert said.startswith("lost the connection to rank 1 ("), (rank, said)


def test_under_a_tcp_store_launcher_the_heartbeat_beats_in_its_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datetime

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
        wait_for_workers=False,
    )  # fmt: skip
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.delenv("PLAIT_STORE", raising=False)
    beat = heartbeat.start_from_env(rank=0, world_size=2)
    assert beat is not None
    try:
        first = int(server.add("plait/heartbeat/beat/0", 0))
        time.sleep(4 * beat.interval_s)
        assert int(server.add("plait/heartbeat/beat/0", 0)) > first
        assert beat.lost(window_s=2 * beat.interval_s) == [1]  # rank 1 never beat
    finally:
        beat.stop()
    monkeypatch.setenv("PLAIT_STORE", "/nonexistent")  # plait's own launcher: no TCP store
    assert heartbeat.start_from_env(rank=0, world_size=2) is None


_EXIT_WHILE_BEATING = """
import datetime, sys, time
import torch.distributed as dist
from plait import heartbeat
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=10))
heartbeat.start(client, 0, 1, interval_s=1e-5)  # nearly always inside a store call
time.sleep(0.1)
"""


def test_a_process_that_ends_while_its_heartbeat_beats_exits_cleanly() -> None:
    """A worker's last act is to end: a heartbeat thread still inside a store call while the
    interpreter finalizes used to abort it ("terminate called without an active
    exception", SIGABRT after its work was done; under torchrun the other node's agent then
    waited at its exit barrier). Six processes end while beating every 10 us; without the
    heartbeat stopped at exit about half of such processes abort on this host."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _EXIT_WHILE_BEATING], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(6)]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "terminate called" not in err, (proc.returncode, err)
