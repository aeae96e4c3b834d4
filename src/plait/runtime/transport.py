"""Point-to-point messages of one rank's stream: receives posted where the program says
and waited by the action that consumes them, sends in flight until they are old enough;
and the bounded wait every communication of a training step goes through.

A window's sends may be received by a peer's later window (an asynchronous pipeline's
windows overlap), so a window does not wait for its own sends: `settle` waits for those of
windows whose receives every peer has posted by now.

Hangs become errors: every wait here lasts at most `timeout_s`, after which it raises
`PipelineTimeout` naming this rank, the action that waited and the peer it waited for. A
peer that crashed is reported by the backend at once ("Connection closed by peer"); one
that stalls would otherwise block this rank for the process group's timeout (torch's
default: 30 min) with an error that names neither the action nor the peer. On gloo an
untimed wait is bounded by that same group timeout, so a timed one costs nothing extra.
On NCCL a timed wait blocks the CPU until the message arrives (torch polls the work,
where an untimed wait only orders the CUDA streams) and aborts the communicator on
expiry; `timeout_s=None` keeps torch's untimed wait, bounded by the group's timeout alone.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime.boundary import BoundaryMeta
from plait.schedule import Action, Op, Schedule

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PipelineTimeout",
    "Transport",
    "check_timeout",
    "timed_wait",
    "timeout_message",
]

Key = tuple[Op, int, int]  # (RECV_F or RECV_B, stage, micro-batch)

#: Seconds a rank waits for a peer's message or reduction before `PipelineTimeout`: far
#: longer than a healthy step (a first step's warm-up included), far shorter than 30 min
DEFAULT_TIMEOUT_S = 300.0


class PipelineTimeout(RuntimeError):
    """A wait for a peer outlasted its timeout: the peer failed, stalled, or is slower than
    the timeout allows. The message names this rank, the action and the peer."""


def timeout_message(
    rank: str, action: str, timeout_s: float, awaited: str, *, peers: int = 1
) -> str:
    """The text of a `PipelineTimeout`: `rank` (``rank 0``) ran `action` (``0B5``, ``REDUCE
    stage 1``) and waited `timeout_s` for `awaited` from `peers` other ranks."""
    who = "the peer" if peers == 1 else "a peer"
    its, their = ("its log", "its") if peers == 1 else ("their logs", "their")
    return (
        f"{rank}: {action} waited {timeout_s:g} s for {awaited}; {who} may have failed or "
        f"stalled: check {its}; raise timeout_s if {their} steps are this slow"
    )


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
        # something else ("Connection closed by peer"), which already says what happened
        if "timed out" not in str(error).lower():
            raise
        raise PipelineTimeout(explain()) from error
    if done is False:  # a backend that reports expiry instead of raising
        raise PipelineTimeout(explain())


def _rank_name(group: dist.ProcessGroup | None, rank: int) -> str:
    """``rank g`` for `rank` of `group` (g its global rank, as in the logs), with the group
    rank when it differs."""
    if group is None or not dist.is_initialized():
        return f"rank {rank}"
    g = dist.get_global_rank(group, rank)
    return f"rank {g}" if g == rank else f"rank {g} (pipeline rank {rank})"


@dataclass
class _Pending:
    """A posted receive: its buffers, the handles to wait on, the action that posted it."""

    buffers: list[torch.Tensor]
    works: list[Any]
    action: Action


class Transport:
    """Sends and receives of `rank` over the pipeline `group` (schedule rank = group rank);
    each wait lasts at most `timeout_s` seconds (see the module's docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        group: dist.ProcessGroup | None,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.schedule, self.rank, self.group = schedule, rank, group
        self.timeout_s = check_timeout(timeout_s)
        self.received: dict[Key, _Pending] = {}
        self.sends: deque[tuple[int, Action, Any]] = deque()  # (window, SEND action, work)

    def peer(self, a: Action) -> int:
        """The rank at the other end of a send or receive."""
        return self.schedule.stage_to_rank[self._peer_stage(a)]

    def _peer_stage(self, a: Action) -> int:
        forward = a.op in (Op.SEND_F, Op.RECV_B)
        s = self.schedule
        neighbour = s.next_stage(a.stage) if forward else s.prev_stage(a.stage)
        assert neighbour is not None, f"{a} has no peer stage"
        return neighbour

    def post(self, a: Action, meta: Mapping[int, BoundaryMeta], device: torch.device) -> None:
        """Post the receive `a` into new buffers shaped as the boundary `meta` (input
        boundary of each stage) says: a RECV_F's activations, a RECV_B's gradients."""
        if a.op is Op.RECV_F:
            buffers = meta[a.stage].empty(device)
        else:
            buffers = meta[self._peer_stage(a)].empty_grads(device)
        peer = self.peer(a)
        works = [dist.irecv(b, group=self.group, group_src=peer) for b in buffers]
        self.received[(a.op, a.stage, a.microbatch)] = _Pending(buffers, works, a)

    def take(self, key: Key, consumer: Action) -> tuple[list[torch.Tensor], float]:
        """The data of a posted receive, waited for by the action `consumer` (named if the
        wait times out): (tensors, seconds waited)."""
        pending = self.received.pop(key)
        t = time.perf_counter()
        for work in pending.works:
            explain = functools.partial(self._explain, consumer, pending.action)
            timed_wait(work, self.timeout_s, explain)
        return pending.buffers, time.perf_counter() - t

    def send(self, a: Action, tensors: list[torch.Tensor], window: int) -> None:
        """Start sending `tensors` (action `a` of window `window`)."""
        peer = self.peer(a)
        for t in tensors:
            work = dist.isend(t.contiguous(), group=self.group, group_dst=peer)
            self.sends.append((window, a, work))

    def settle(self, up_to: int) -> None:
        """Wait for the sends of windows up to `up_to` (their peers posted the receives);
        a send that times out is named by its SEND action."""
        while self.sends and self.sends[0][0] <= up_to:
            _, a, work = self.sends.popleft()
            timed_wait(work, self.timeout_s, functools.partial(self._explain, a, a))

    def _explain(self, waiter: Action, message: Action) -> str:
        """Why `waiter` timed out on the message of the SEND or RECV action `message`."""
        assert self.timeout_s is not None
        what = "activations" if message.op in (Op.SEND_F, Op.RECV_F) else "gradients"
        peer = f"{_rank_name(self.group, self.peer(message))} (stage {self._peer_stage(message)})"
        if message.op in (Op.SEND_F, Op.SEND_B):
            awaited = f"{peer} to receive the {what} of stage {message.stage}"
        else:
            awaited = f"the {what} from {peer}"
        return timeout_message(
            _rank_name(self.group, self.rank), str(waiter), self.timeout_s, awaited
        )
