"""Point-to-point messages of one rank's stream: receives posted where the program says
and waited by the action that consumes them, sends in flight until they are old enough,
each on its channel's process group, each waited through `plait.wait.timed_wait`.

A window's sends may be received by a peer's later window (an asynchronous pipeline's
windows overlap), so a window does not wait for its own sends: `settle` waits for those of
windows whose receives every peer has posted by now.

Hangs become errors: see `plait.wait`.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.runtime.channels import Channels
from plait.schedule import Action, Op, Schedule
from plait.schedule.lower import Batch, Message
from plait.wait import DEFAULT_TIMEOUT_S, check_timeout, timed_wait, timeout_message

__all__ = ["Transport"]

Key = tuple[Op, int, int]  # (RECV_F or RECV_B, stage, micro-batch)


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
