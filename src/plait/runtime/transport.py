"""Point-to-point messages of one rank's stream: receives posted where the program says
and waited by the action that consumes them, sends in flight until they are old enough,
each on its channel's process group; and the bounded wait every communication of a
training step goes through.

A window's sends may be received by a peer's later window (an asynchronous pipeline's
windows overlap), so a window does not wait for its own sends: `settle` waits for those of
windows whose receives every peer has posted by now.

Hangs become errors: every wait here lasts at most `timeout_s`, after which it raises
`PipelineTimeout` naming this rank, the action that waited and the peer it waited for. A
peer that crashed is reported by the backend at once ("Connection closed by peer"); one
that stalls would otherwise block this rank for the process group's timeout (torch's
default: 30 min) with an error that names neither the action nor the peer. On gloo an
untimed wait is bounded by that same group timeout, so a timed one costs nothing extra.
On NCCL a timed wait would block the CPU until the message arrives (torch polls the work,
where an untimed wait only orders the CUDA streams), so a GPU's messages are waited on
untimed (`Transport(stream_ordered=True)`), bounded by the group's timeout alone, which
NCCL's watchdog enforces; `timeout_s=None` does the same on CPU workers.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime.channels import Channels
from plait.schedule import Action, Op, Schedule
from plait.schedule.lower import Batch, Message

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


def _rank_name(channels: Channels | None, rank: int) -> str:
    """``rank g`` for pipeline rank `rank` (g its global rank, as in the logs), with the
    pipeline rank when it differs."""
    if channels is None:
        return f"rank {rank}"
    g = channels.global_rank(rank)
    return f"rank {g}" if g == rank else f"rank {g} (pipeline rank {rank})"


@dataclass
class _Pending:
    """A posted receive: its buffers, the handles to wait on, the action that posted it."""

    buffers: list[torch.Tensor]
    works: list[Any]
    action: Action


class Transport:
    """Messages of pipeline rank `rank`, on its `channels` (a process group per directed
    pair of pipeline ranks, `plait.runtime.channels`), issued as the lowered program's
    batches say (`plait.schedule.lower`).

    On a GPU (`stream_ordered`) a wait orders the computing stream after the message and
    returns at once: the host never blocks, and a hang surfaces as the process group's
    timeout (NCCL's watchdog). On CPU workers every wait blocks for at most `timeout_s`
    seconds (see the module's docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        channels: Channels | None,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        stream_ordered: bool = False,
    ) -> None:
        self.schedule, self.rank, self.channels = schedule, rank, channels
        self.timeout_s = check_timeout(timeout_s)
        self.stream_ordered = stream_ordered
        self.received: dict[Key, _Pending] = {}
        self.sends: deque[tuple[int, Action, Any]] = deque()  # (window, SEND action, work)

    def send(self, batch: Batch, tensors: list[list[torch.Tensor]], window: int) -> None:
        """Start sending each message of `batch` (its tensors), of window `window`."""
        ops = [
            (m.action, (dist.isend, t.contiguous(), m))
            for m, leaves in zip(batch.messages, tensors, strict=True)
            for t in leaves
        ]
        for (a, _), work in zip(ops, self._issue([op for _, op in ops]), strict=True):
            self.sends.append((window, a, work))

    def post(self, message: Message, buffers: list[torch.Tensor]) -> None:
        """Post the receive of `message` into `buffers` (pre-sized by the lowering)."""
        works = self._issue([(dist.irecv, b, message) for b in buffers])
        self.received[message.key] = _Pending(buffers, works, message.action)

    def _issue(self, ops: list[tuple[Any, torch.Tensor, Message]]) -> list[Any]:
        """Issue `ops` (isend or irecv, tensor, message) on their channels: one call, or one
        `batch_isend_irecv` for several."""
        assert self.channels is not None, "a pipeline of one rank sends nothing"
        channels = self.channels
        resolved = [
            (fn, t, channels.global_rank(m.peer), channels.group(*m.channel)) for fn, t, m in ops
        ]
        if len(resolved) == 1:
            fn, t, peer, group = resolved[0]
            return [fn(t, peer, group)]
        return list(dist.batch_isend_irecv([dist.P2POp(*op) for op in resolved]))

    def take(self, key: Key, consumer: Action) -> tuple[list[torch.Tensor], float]:
        """The data of a posted receive, waited for by the action `consumer` (named if the
        wait times out): (tensors, seconds the host waited)."""
        pending = self.received.pop(key)
        t = time.perf_counter()
        for work in pending.works:
            self._wait(work, consumer, pending.action)
        return pending.buffers, time.perf_counter() - t

    def settle(self, up_to: int) -> None:
        """Wait for the sends of windows up to `up_to` (their peers posted the receives);
        a send that times out is named by its SEND action."""
        while self.sends and self.sends[0][0] <= up_to:
            _, a, work = self.sends.popleft()
            self._wait(work, a, a)

    def _wait(self, work: Any, waiter: Action, message: Action) -> None:
        if self.stream_ordered:
            work.wait()  # orders the current stream after it: no host sync
            return
        timed_wait(work, self.timeout_s, functools.partial(self._explain, waiter, message))

    def peer(self, a: Action) -> int:
        """The pipeline rank at the other end of a send or receive."""
        return self.schedule.stage_to_rank[self._peer_stage(a)]

    def _peer_stage(self, a: Action) -> int:
        forward = a.op in (Op.SEND_F, Op.RECV_B)
        s = self.schedule
        neighbour = s.next_stage(a.stage) if forward else s.prev_stage(a.stage)
        assert neighbour is not None, f"{a} has no peer stage"
        return neighbour

    def _explain(self, waiter: Action, message: Action) -> str:
        """Why `waiter` timed out on the message of the SEND or RECV action `message`."""
        assert self.timeout_s is not None
        what = "activations" if message.op in (Op.SEND_F, Op.RECV_F) else "gradients"
        channels, peer = self.channels, self.peer(message)
        peer_name = f"{_rank_name(channels, peer)} (stage {self._peer_stage(message)})"
        if message.op in (Op.SEND_F, Op.SEND_B):
            awaited = f"{peer_name} to receive the {what} of stage {message.stage}"
        else:
            awaited = f"the {what} from {peer_name}"
        return timeout_message(_rank_name(channels, self.rank), str(waiter), self.timeout_s,
                               awaited)  # fmt: skip
