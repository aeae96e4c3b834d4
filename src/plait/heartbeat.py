"""Which ranks are gone, when a collective only says that a connection broke.

When a peer's process or machine dies, gloo and NCCL report a broken socket ("Connection
closed by peer [10.0.0.2]:40213"), with an address and no rank. A rank waiting on that peer
in a timed point-to-point wait knows whom it waited for (`plait.wait.PeerLost`); a rank
inside a collective (a clipped norm's reduction, a DCP save's plan exchange) does not. Each
worker therefore counts up a key of its own in the launch's store every `interval_s` from a
daemon thread; a rank whose connection broke marks itself a survivor, reads every count,
waits a few intervals and reads again: the ranks whose counts stood still and that did not
mark themselves are the ones gone.

torch's elastic agents keep heartbeats of their own, per node and inside the rendezvous;
they are not readable from a worker, and they say which node, not which rank, left. The
counts live under their own prefix in the worker group's store (a client of its own, so the
thread never waits behind the process group's use of it); a store that cannot be reached
answers "unknown", and the backend's message stands.
"""

from __future__ import annotations

import atexit
import datetime
import re
import threading
import time
from typing import Any

from plait.wait import BROKEN_CONNECTION, backend_cause

__all__ = ["Heartbeat", "current", "explain_lost", "start", "start_from_env"]

_PREFIX = "plait/heartbeat/"


class Heartbeat:
    """A daemon thread counting up this rank's key in `store` every `interval_s`."""

    def __init__(self, store: Any, rank: int, world_size: int, interval_s: float = 0.5) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._beat()  # the key exists before anyone reads it
        self._thread = threading.Thread(target=self._run, name="plait-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.add(f"{_PREFIX}beat/{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store is gone: nothing left to tell it
                return

    def stop(self, wait_s: float = 15.0) -> None:
        """Stop beating and wait (up to `wait_s`: a beat may be waiting on a store that is
        gone, for its client's 10 s timeout) for the thread to end. A daemon thread still
        inside a store call when the interpreter finalizes is ended by Python 3.11 with a
        forced unwind through torch's C++ frames, which aborts the process ("terminate
        called without an active exception", a SIGABRT after the run's work was done)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)

    def lost(self, window_s: float | None = None) -> list[int] | None:
        """The ranks gone: their counts stood still over `window_s` (default: four beats)
        and they did not say they survived. None when the store cannot answer."""
        window = 4 * self.interval_s if window_s is None else window_s
        try:
            self.store.set(f"{_PREFIX}survivor/{self.rank}", "1")
            before = self._counts()
            time.sleep(window)
            after = self._counts()
            survivors = {
                r for r in range(self.world_size) if self.store.check([f"{_PREFIX}survivor/{r}"])
            }
        except Exception:
            return None
        return [
            r for r in range(self.world_size)
            if r not in survivors and after.get(r, 0) == before.get(r, 0)
        ]  # fmt: skip

    def _counts(self) -> dict[int, int]:
        keys = {r: f"{_PREFIX}beat/{r}" for r in range(self.world_size)}
        return {r: int(self.store.add(k, 0)) for r, k in keys.items() if self.store.check([k])}


_current: Heartbeat | None = None


def start(store: Any, rank: int, world_size: int, interval_s: float = 0.5) -> Heartbeat:
    """Start this process's heartbeat in `store` (replacing an earlier one)."""
    global _current
    if _current is not None:
        _current.stop()
    else:  # once per process: atexit runs it before the interpreter finalizes
        atexit.register(_stop_current)
    _current = Heartbeat(store, rank, world_size, interval_s)
    return _current


def _stop_current() -> None:
    if _current is not None:
        _current.stop()


def start_from_env(rank: int, world_size: int) -> Heartbeat | None:
    """Under a launcher that meets on a TCP store (torchrun: MASTER_ADDR and MASTER_PORT),
    start the heartbeat in it through a client of its own; else None. Called after the
    process group exists, so the store is up."""
    import os

    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or os.environ.get("PLAIT_STORE"):  # plait's launcher: a file
        return None
    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10),
            wait_for_workers=False,
        )  # fmt: skip
    except Exception:  # no store to beat in: a broken connection then names no rank
        return None
    return start(client, rank, world_size)


def current() -> Heartbeat | None:
    return _current


def explain_lost(cause: str) -> str:
    """`cause` (a worker's one-line error), naming the ranks gone when it is a broken
    connection the backend reported without them; `cause` unchanged otherwise."""
    beat = _current
    peer_lost = "lost the connection while waiting for" in cause  # a `PeerLost`'s text
    broken = peer_lost or any(b in cause.lower() for b in BROKEN_CONNECTION)
    if beat is None or not broken:
        return cause
    if peer_lost and re.search(r"waiting for [^(]*\brank \d+", cause):
        return cause  # the wait was for a peer it names
    gone = beat.lost()
    if not gone:
        return cause
    names = ", ".join(f"rank {r}" for r in gone)
    if peer_lost:  # a timed collective's wait: it knows what it waited for, not who left
        return cause.replace("lost the connection", f"lost the connection to {names}", 1)
    return (
        f"lost the connection to {names} ({backend_cause(cause)}): that rank's process or "
        "its machine is gone; check its log"
    )
