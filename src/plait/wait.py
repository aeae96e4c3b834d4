"""The bounded wait every communication of a training step goes through, and the error
that names who waited for whom when it expires.

Hangs become errors: every wait here lasts at most `timeout_s`, after which it raises
`PipelineTimeout` naming this rank, the action that waited and the peer it waited for. A
peer that crashed is reported by the backend at once ("Connection reset by peer"), with
the address of a socket but not the rank: that error becomes `PeerLost`, naming the rank,
the action and the peer as a timeout would. One that stalls would otherwise block this
rank for the process group's timeout (torch's default: 30 min) with an error that names
neither the action nor the peer. On gloo an
untimed wait is bounded by that same group timeout, so a timed one costs nothing extra.
On NCCL a timed wait would block the CPU until the message arrives (torch polls the work,
where an untimed wait only orders the CUDA streams), so a GPU's messages are waited on
untimed (`Transport(stream_ordered=True)`), bounded by the group's timeout alone, which
NCCL's watchdog enforces; `timeout_s=None` does the same on CPU workers.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "BROKEN_CONNECTION",
    "DEFAULT_TIMEOUT_S",
    "Explained",
    "PeerLost",
    "PipelineTimeout",
    "backend_cause",
    "check_timeout",
    "named_timeout",
    "timed_wait",
    "timeout_message",
]

#: Seconds a rank waits for a peer's message or reduction before `PipelineTimeout`: far
#: longer than a healthy step (a first step's warm-up included), far shorter than 30 min
DEFAULT_TIMEOUT_S = 300.0


class PipelineTimeout(RuntimeError):
    """A wait for a peer outlasted its timeout: the peer failed, stalled, or is slower than
    the timeout allows. The message names this rank, the action and the peer."""


class PeerLost(RuntimeError):
    """A wait for a peer ended because the connection to it broke: the peer's process (or
    its machine) is gone. The message names this rank, the action and the peer."""


# what gloo and NCCL say when the process at the other end of a connection is gone
BROKEN_CONNECTION = ("connection reset", "connection closed", "broken pipe", "connection refused")


class Explained(str):
    """A `timeout_message`: its text, and the parts another error about the same wait
    reuses (`rank`: ``rank 0``, `action`, `awaited`)."""

    rank: str
    action: str
    awaited: str

    # the parts default to "" so that pickle, which rebuilds a str from its text alone
    # before restoring the attributes, can rebuild one sent to another process
    def __new__(cls, text: str, rank: str = "", action: str = "", awaited: str = "") -> Explained:
        made = super().__new__(cls, text)
        made.rank, made.action, made.awaited = rank, action, awaited
        return made


def timeout_message(
    rank: str, action: str, timeout_s: float | None, awaited: str, *, peers: int = 1
) -> Explained:
    """The text of a `PipelineTimeout`: `rank` (``rank 0``) ran `action` (``0B5``, ``REDUCE
    stage 1``) and waited `timeout_s` for `awaited` from `peers` other ranks."""
    who = "the peer" if peers == 1 else "a peer"
    its, their = ("its log", "its") if peers == 1 else ("their logs", "their")
    waited = "the process group's timeout" if timeout_s is None else f"{timeout_s:g} s"
    return Explained(
        f"{rank}: {action} waited {waited} for {awaited}; {who} may have failed or "
        f"stalled: check {its}; raise timeout_s if {their} steps are this slow",
        rank, action, awaited,
    )  # fmt: skip


def check_timeout(timeout_s: float | None) -> float | None:
    """`timeout_s`, refused unless None or at least a millisecond (torch counts whole
    milliseconds and takes 0 ms for no timeout at all)."""
    if timeout_s is not None and not timeout_s >= 1e-3:
        raise ValueError(
            f"timeout_s={timeout_s!r}: give at least 0.001 seconds, or None to wait as long "
            "as the process group's timeout"
        )
    return timeout_s


def timed_wait(work: Any, timeout_s: float | None, explain: Callable[[], str]) -> None:
    """Wait for `work` (a torch.distributed Work) at most `timeout_s` seconds (None: the
    process group's timeout); on expiry raise `PipelineTimeout(explain())`."""
    if timeout_s is None:
        work.wait()
        return
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        # gloo raises "Timed out waiting ... ms" (p2p) or "Operation timed out!"
        # (collectives), NCCL "... timed out in blocking wait"; a peer that crashed raises
        # something else ("Connection reset by peer"), which names an address, not a rank
        if "timed out" not in str(error).lower():
            if any(b in str(error).lower() for b in BROKEN_CONNECTION):
                raise PeerLost(_lost(explain(), error)) from error
            raise
        raise PipelineTimeout(explain()) from error
    if done is False:  # a backend that reports expiry instead of raising
        raise PipelineTimeout(explain())


def _lost(explained: str, error: RuntimeError) -> str:
    """`PeerLost`'s text, from what the same wait would have timed out with (`explained`,
    a `timeout_message`; its parts, where it carries them) and the backend's error."""
    if isinstance(explained, Explained):
        head, awaited = f"{explained.rank}: {explained.action}", explained.awaited
    else:  # an explanation written by hand: "RANK: ACTION waited T for AWAITED; ..."
        head, _, rest = explained.partition(" waited ")
        awaited = rest.partition(" for ")[2].partition("; ")[0] or "a peer"
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    cause = backend_cause(cause)
    return (
        f"{head} lost the connection while waiting for {awaited} ({cause}): that rank's "
        "process or its machine is gone; check its log"
    )


def backend_cause(text: str) -> str:
    """A backend's error line without the C++ source location torch prefixes and the advice
    gloo appends ("[.../pair.cc:553] Connection closed by peer [127.0.0.1]:29917. This is
    typically caused by ..." -> "Connection closed by peer [127.0.0.1]:29917")."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically", 1)[0]


@contextlib.contextmanager
def named_timeout(explain: Callable[[], str]) -> Iterator[None]:
    """Blocking collectives (the clipped norm's reduction over the stages, the fp16
    overflow flag's) wait the process group's timeout and raise the backend's bare error;
    this turns that error into `PipelineTimeout(explain())`, which names the rank and what
    it waited for. Other errors pass unchanged."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, PipelineTimeout) or "timed out" not in str(error).lower():
            raise
        raise PipelineTimeout(explain()) from error
