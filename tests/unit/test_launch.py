"""Which failure a launch reports, and how: the root cause among the workers that ended."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

import pytest

from plait.train.launch import WorkerFailed, WorkerFailure, _root_cause, launch


@dataclass
class _Failure:  # the fields of torch's ProcessFailure that the launcher reads
    exitcode: int
    timestamp: int
    error_file_data: dict[str, Any] = field(default_factory=dict)

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


@dataclass
class _ChildFailed:
    failures: dict[int, _Failure]


def _raised(message: str, timestamp: int) -> _Failure:
    data = {"message": {"message": message, "extraInfo": {"py_callstack": f"Traceback\n{message}"}}}
    return _Failure(exitcode=1, timestamp=timestamp, error_file_data=data)


def test_a_killed_worker_is_the_cause_not_the_peers_that_lost_it() -> None:
    err = _ChildFailed({
        0: _raised("RuntimeError: Connection closed by peer [127.0.0.1]:1234", 100),
        3: _Failure(exitcode=-signal.SIGKILL, timestamp=105),
    })  # fmt: skip
    assert _root_cause(err) == WorkerFailure(3, "SIGKILL")


def test_an_error_comes_before_the_timeouts_it_caused() -> None:
    err = _ChildFailed({
        0: _raised("PipelineTimeout: rank 0 waited 5 s in 1F3 for rank 1", 100),
        1: _raised("ValueError: bad shape", 101),
    })  # fmt: skip
    cause = _root_cause(err)
    assert (cause.rank, cause.cause) == (1, "ValueError: bad shape")
    assert "ValueError" in cause.traceback


def test_a_workers_own_report_counts_when_the_agent_saw_only_its_peer(tmp_path: Any) -> None:
    """The agent reports the first worker it sees end; a failed save's rank may end after
    the peer that lost it, and its error file under the launch's logs still names it."""
    import json

    from plait.train.launch import _error_files

    saved = "SaveFailed: OSError: [Errno 28] No space left on device while saving step 4"
    folder = tmp_path / "plait-xyz" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    info = {"py_callstack": "Traceback", "timestamp": "100"}
    (folder / "error.json").write_text(json.dumps({"message": {"message": saved,
                                                               "extraInfo": info}}))  # fmt: skip
    agent_saw = _ChildFailed({1: _raised("PeerLost: rank 1: 1F3 lost the connection", 99)})
    cause = _root_cause(agent_saw, _error_files(str(tmp_path)))
    assert (cause.rank, cause.cause) == (0, saved)


def test_among_equals_the_earliest_then_the_lowest_rank() -> None:
    err = _ChildFailed(
        {2: _raised("OSError: a", 7), 1: _raised("OSError: b", 7), 0: _raised("OSError: c", 9)}
    )
    assert _root_cause(err).rank == 1
    plain = _ChildFailed({1: _Failure(exitcode=3, timestamp=1)})
    assert _root_cause(plain) == WorkerFailure(1, "exit code 3")


def test_the_message_names_the_rank_the_cause_and_the_restarts() -> None:
    assert str(WorkerFailed(WorkerFailure(2, "SIGKILL"), 0)) == "rank 2 failed (SIGKILL)"
    assert str(WorkerFailed(WorkerFailure(0, "exit code 3"), 2)) == (
        "rank 0 failed (exit code 3) after 2 restarts"
    )


@pytest.mark.parametrize("nproc, restarts", [(0, 0), (2, -1)])
def test_bad_launch_arguments_fail_before_any_worker(nproc: int, restarts: int) -> None:
    with pytest.raises(ValueError, match=r"nproc=0|max_restarts=-1"):
        launch(print, nproc, max_restarts=restarts)


def test_under_torchrun_restarts_must_be_asked_of_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.cli.main import main

    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for key, value in {**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"}.items():
        monkeypatch.setenv(key, value)
    code = main(["train", "--pp", "2", "--checkpoint-every", "2", "--max-restarts", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "pass --max-restarts 1 to torchrun" in err and "started with --max-restarts 0" in err


def test_under_torchrun_restarts_need_the_agents_shared_store_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.cli.main import main

    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "TORCHELASTIC_MAX_RESTARTS": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    for key, value in torchrun.items():
        monkeypatch.setenv(key, value)
    code = main(["train", "--pp", "2", "--checkpoint-every", "2", "--dry-run"])
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in err and "--max-restarts 1" in err
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what that variable gives
    assert main(["train", "--pp", "2", "--checkpoint-every", "2", "--dry-run"]) == 0


def test_under_torchrun_a_rank_is_named_with_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.cli.train import _with_nodes

    text = "rank 0: 0B3 lost the connection while waiting for the gradients from rank 3"
    assert _with_nodes(text) == text  # not under torchrun: no nodes to name
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "0")
    assert _with_nodes(text) == (
        "rank 0 (node 0): 0B3 lost the connection while waiting for the gradients from "
        "rank 3 (node 1)"
    )


def test_a_broken_connection_names_the_peer_it_was_waiting_for() -> None:
    from plait.wait import PeerLost, timed_wait, timeout_message

    class Broken:
        def wait(self, timeout: object = None) -> bool:
            raise RuntimeError(
                "[/__w/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:27045: "
                "Connection reset by peer. This is typically caused by a remote worker"
            )

    explain = lambda: timeout_message("rank 0", "0B3", 20, "the gradients from rank 1 (stage 1)")  # noqa: E731
    with pytest.raises(PeerLost) as lost:
        timed_wait(Broken(), 20, explain)
    assert str(lost.value) == (
        "rank 0: 0B3 lost the connection while waiting for the gradients from rank 1 "
        "(stage 1) (Read error [127.0.0.1]:27045: Connection reset by peer): that rank's "
        "process or its machine is gone; check its log"
    )


def test_a_backends_bare_timeout_reads_as_one_line_that_says_so() -> None:
    raw = (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "unbound_buffer.cc:81] Timed out waiting 8000ms for recv operation to complete"
    )
    cause = _root_cause(_ChildFailed({0: _raised(raw, 5)})).cause
    assert cause.startswith("timed out in a collective waiting for a peer (Timed out waiting")
    assert "unbound_buffer.cc" not in cause and "--timeout" in cause
    other = _root_cause(_ChildFailed({0: _raised("RuntimeError: [x/y.cpp:3] bad", 5)})).cause
    assert other == "RuntimeError: bad"


def test_a_ctrl_c_while_the_workers_start_is_answered_after_every_worker_is_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel may hand the group's SIGINT to another thread, which then runs Python's
    handler in the main thread mid-start: the launcher must hold it until the start is over."""
    import os
    import threading
    import time

    from torch.distributed.elastic.multiprocessing import api

    from plait.train.launch import _workers_start_sigint_blocked

    seen: list[str] = []

    def start_all(context: Any) -> None:
        # a thread with SIGINT unblocked takes the signal, as the agent's threads would
        sender = threading.Thread(target=lambda: os.kill(os.getpid(), signal.SIGINT))
        sender.start()
        sender.join()
        for _ in range(200):  # bytecodes run here: an unheld handler would raise in them
            time.sleep(0.001)
        seen.append("started")

    monkeypatch.setattr(api.MultiprocessContext, "_start", start_all)
    # an earlier launch in this process may have left torch's own handler installed, or
    # SIGINT blocked in this thread: start from Python's handler, the signal deliverable
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with pytest.raises(KeyboardInterrupt), _workers_start_sigint_blocked():
            api.MultiprocessContext._start(None)  # type: ignore[arg-type]
            time.sleep(1)  # the held signal is answered as the start returns, not later
            seen.append("not interrupted")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, before)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert seen == ["started"]
