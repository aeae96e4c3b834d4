"""Starting N local workers through torch's elastic launcher (torchrun's machinery), with
restarts after a lost worker, one-line failures and nothing listening beyond loopback.

Restarts. torch's elastic agent can restart a failed worker group itself, but it reports
the failure only in its own log and gives no hook between the failure and the restart.
So each attempt here is one elastic launch without restarts, and the loop around it
restarts: it knows which rank failed and why (the agent's `ChildFailedError`), tells the
caller before the next attempt (which names the step it resumes from) and counts the
attempt in `PLAIT_ATTEMPT`, which `plait.mesh.restart_count` reads as it reads torchrun's
`TORCHELASTIC_RESTART_COUNT`. Under torchrun, torchrun's own `--max-restarts` restarts.

Loopback. torch's TCPStore listens on every interface and has no option to bind one, so
a local launch uses no TCPStore at all: the agent's rendezvous and the workers' process
group meet in a `FileStore` in a private temporary folder, and gloo (NCCL's bootstrap)
binds the loopback interface. The only sockets open are the workers' on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from plait.train.agent import cheap_rendezvous_names, stopped_workers_end

__all__ = ["Interrupted", "WorkerFailed", "WorkerFailure", "free_port", "launch"]

STORE_ENV, ATTEMPT_ENV = "PLAIT_STORE", "PLAIT_ATTEMPT"
# launcher logs that a failure or a Ctrl-C would otherwise print as pages of tracebacks;
# PLAIT_LAUNCH_LOG=1 shows them
_QUIET = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
# errors a worker raises because a peer died: they follow the failure, they are not it
_PEER_LOST = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "PipelineTimeout",
    "PeerLost",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class WorkerFailure:
    """Why one worker ended: its global rank, a one-line cause (`SIGKILL`, `exit code 3`,
    `RuntimeError: ...`) and its traceback when it raised."""

    rank: int
    cause: str
    traceback: str = ""

    @property
    def signalled(self) -> bool:
        return self.cause.startswith("SIG")


class WorkerFailed(RuntimeError):
    """The workers failed and no restart was left."""

    def __init__(self, failure: WorkerFailure, restarts: int) -> None:
        after = f" after {restarts} restart{'s' * (restarts != 1)}" if restarts else ""
        super().__init__(f"rank {failure.rank} failed ({failure.cause}){after}")
        self.failure, self.restarts = failure, restarts


class Interrupted(RuntimeError):
    """The launch got SIGINT or SIGTERM; the workers have been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _worker(fn: Callable[..., Any], *args: Any) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import record

    # a terminal's Ctrl-C reaches every process of the group: the launcher answers it (it
    # names the checkpoint to resume from), a worker ends at once, without the traceback of
    # a KeyboardInterrupt. It started with SIGINT blocked (`_workers_start_sigint_blocked`):
    # a Ctrl-C pressed while it started ends it as SIGINT is unblocked
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    # `record` writes the worker's traceback where the launcher reports it
    result = record(fn)(*args)
    gc.freeze()  # as `python -m plait` does: exit without collecting torch's objects
    return result


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    threads: int = 1,
    max_restarts: int = 0,
    on_restart: Callable[[WorkerFailure, int], None] | None = None,
) -> dict[int, Any]:
    """Run `fn(*args)` on `nproc` local worker processes; returns {rank: return value}.

    Each worker finds RANK, WORLD_SIZE, LOCAL_RANK in its environment (read them with
    `plait.mesh.worker_env`; `plait.mesh.init_worker` joins the process group). When a
    worker fails, all are stopped and, up to `max_restarts` times, started again;
    `on_restart(failure, k)` is called before the k-th restart. Raises `WorkerFailed` when
    no restart is left and `Interrupted` on SIGINT/SIGTERM. `fn` must be importable.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: launch at least 1 worker")
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts}: give 0 or more")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    for attempt in range(max_restarts + 1):
        try:
            return _attempt(fn, nproc, args, attempt)
        except _Failed as failed:
            if failed.failure.cause == "SIGINT":  # a Ctrl-C that reached a worker first
                raise Interrupted(signal.SIGINT) from None
            if attempt == max_restarts:
                raise WorkerFailed(failed.failure, attempt) from None
            if on_restart is not None:
                on_restart(failed.failure, attempt + 1)
    raise AssertionError("unreachable")


class _Failed(Exception):
    def __init__(self, failure: WorkerFailure) -> None:
        self.failure = failure


def _attempt(
    fn: Callable[..., Any], nproc: int, args: tuple[Any, ...], attempt: int
) -> dict[int, Any]:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    folder = tempfile.mkdtemp(prefix="plait-launch-")
    env = {
        STORE_ENV: os.path.join(folder, "store"),
        ATTEMPT_ENV: str(attempt),
        # the agent shares no TCPStore with the workers (see the module docstring)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    loopback = _loopback_interface()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=os.path.join(folder, "rendezvous"),
        rdzv_configs={"store_type": "file"},
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(folder, "logs")),
    )
    try:
        with (
            _environment(env, loopback),
            _quiet_launcher(),
            _workers_start_sigint_blocked(),
            stopped_workers_end(),
            cheap_rendezvous_names(),
        ):
            return dict(elastic_launch(config, _worker)(fn, *args))
    except ChildFailedError as err:
        raise _Failed(_root_cause(err, _error_files(os.path.join(folder, "logs")))) from None
    except SignalException as err:
        raise Interrupted(int(err.sigval)) from None
    except KeyboardInterrupt:
        raise Interrupted(signal.SIGINT) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _loopback_interface() -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the loopback interface, unless set."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    lo = next((n for n in names if n == "lo" or n.startswith("lo")), None)
    if lo is None:
        return {}
    return {k: lo for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ}


@contextlib.contextmanager
def _environment(*updates: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `updates` while the workers start (spawned workers inherit it)."""
    merged = {k: v for u in updates for k, v in u.items()}
    saved = {k: os.environ.get(k) for k in merged}
    os.environ.update(merged)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _workers_start_sigint_blocked() -> Iterator[None]:
    """Spawn the workers with SIGINT blocked; this process keeps answering it.

    A spawned worker imports torch for seconds before `_worker` can ignore SIGINT, and a
    Ctrl-C in that time printed a KeyboardInterrupt traceback per worker. A blocked signal
    stays blocked across fork and exec, so each worker process is created (multiprocessing's
    `spawnv_passfds`, which the spawn start method calls) with SIGINT blocked in this thread
    for the call alone: a Ctrl-C meanwhile reaches this process once the call returns, and
    ends the worker, silently, when `_worker` unblocks it. Blocking it for the whole launch
    would not do: Python's resource tracker unblocks SIGINT as it starts, and a signal
    taken by another thread reaches Python's handler late (CPython 3.11)."""
    from multiprocessing import util

    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    from multiprocessing import resource_tracker

    from torch.distributed.elastic.multiprocessing import api

    original, start_all = util.spawnv_passfds, api.MultiprocessContext._start

    def spawn(path: Any, args: Any, passfds: Any) -> Any:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return original(path, args, passfds)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def start(context: Any) -> None:
        # a Ctrl-C answered between two workers' starts would leave the ones started but
        # not yet recorded in the context unstopped: each then reads its start-up data
        # from a parent that has gone and prints a traceback. Held until every worker is
        # recorded, it stops them all. The resource tracker, which restores this thread's
        # mask as it starts, is started first. Blocking the signal in this thread is not
        # enough: the kernel hands a process-group signal to any thread that has it
        # unblocked (the agent's own threads), and Python then runs the handler in this
        # thread at its next bytecode, in the middle of a worker's start. So the handlers
        # only note the signal while the workers start, and it is raised again after.
        resource_tracker.ensure_running()
        held: list[int] = []
        handlers = {
            s: signal.signal(s, lambda signum, _frame: held.append(signum))
            for s in (signal.SIGINT, signal.SIGTERM)
        }
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            start_all(context)  # type: ignore[no-untyped-call]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            for s, handler in handlers.items():
                signal.signal(s, handler)
            if held:
                signal.raise_signal(held[0])

    util.spawnv_passfds = spawn
    api.MultiprocessContext._start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        util.spawnv_passfds = original
        api.MultiprocessContext._start = start_all  # type: ignore[method-assign]


class _DropLauncherLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL or not record.name.startswith(_QUIET)


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    if os.environ.get("PLAIT_LAUNCH_LOG") == "1":
        yield
        return
    quiet = _DropLauncherLogs()
    handlers: set[logging.Handler] = set()
    for name in _QUIET:  # the handlers that print these loggers' records: their ancestors'
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            handlers.update(logger.handlers)
            logger = logger.parent
    for h in handlers:
        h.addFilter(quiet)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def _error_files(logs: str) -> dict[int, Any]:
    """Every failed worker's report under the launch's `logs` folder, by rank (the error
    file torch's `record` writes). The agent reports only the first worker it sees end,
    and a worker that lost its peer often ends before the one whose error started it (a
    failed save's rank is still tearing down its threads)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    found: dict[int, Any] = {}
    for path in glob.glob(os.path.join(logs, "*", "attempt_*", "*", "error.json")):
        rank = os.path.basename(os.path.dirname(path))  # one node: local rank = rank
        with contextlib.suppress(ValueError, OSError):
            found[int(rank)] = ProcessFailure(int(rank), pid=0, exitcode=1, error_file=path)
    return found


def _root_cause(err: Any, reports: dict[int, Any] | None = None) -> WorkerFailure:
    """The failure that started it, among the agent's and the workers' own `reports`: a
    worker killed by a signal before one that raised, one that raised before one that
    lost its peer, then the earliest, then the lowest rank."""
    reported = {**(reports or {}), **err.failures}
    failures = [_describe(rank, f) for rank, f in reported.items()]
    stamps = {rank: f.timestamp for rank, f in reported.items()}

    def order(f: WorkerFailure) -> tuple[int, int, int]:
        peer_lost = any(p.lower() in f.cause.lower() for p in _PEER_LOST)
        kind = 0 if f.signalled and f.cause not in ("SIGTERM", "SIGINT") else 1 + peer_lost
        return kind, stamps[f.rank], f.rank

    return min(failures, key=order)


# a C++ source location torch prefixes to a backend's error: "[/path/to/file.cc:81] "
_SOURCE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _backend_timeout(message: str) -> str:
    """A backend's bare timeout (gloo's "Timed out waiting 8000ms for recv operation to
    complete", raised by a blocking collective outside plait's named waits) as a line that
    says what it means; any other message unchanged but for its C++ source location."""
    cleaned = _SOURCE.sub("", message)
    if "timed out" not in cleaned.lower() or "PipelineTimeout" in cleaned:
        return cleaned
    detail = cleaned.split(": ", 1)[-1]
    return (
        f"timed out in a collective waiting for a peer ({detail}); a peer may have failed or "
        "stalled: check its log; raise --timeout if steps are this slow"
    )


def _describe(rank: int, failure: Any) -> WorkerFailure:
    if failure.exitcode < 0:
        return WorkerFailure(rank, failure.signal_name())
    data = failure.error_file_data.get("message") if failure.error_file_data else None
    if isinstance(data, dict) and data.get("message"):
        message = _backend_timeout(str(data["message"]).strip().splitlines()[0])[:400]
        trace = str(data.get("extraInfo", {}).get("py_callstack", ""))
        return WorkerFailure(rank, message, trace)
    return WorkerFailure(rank, f"exit code {failure.exitcode}")
