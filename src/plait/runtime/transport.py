"""Point-to-point messages of one rank's stream: receives posted where the program says
and waited by the action that consumes them, sends in flight until they are old enough.

A window's sends may be received by a peer's later window (an asynchronous pipeline's
windows overlap), so a window does not wait for its own sends: `settle` waits for those of
windows whose receives every peer has posted by now.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.schedule import Action, Op, Schedule

__all__ = ["Transport"]

Key = tuple[Op, int, int]  # (RECV_F or RECV_B, stage, micro-batch)


@dataclass
class _Pending:
    """A posted receive: its buffers and the handles to wait on."""

    buffers: list[torch.Tensor]
    works: list[Any]


class Transport:
    """Sends and receives of `rank` over the pipeline `group` (schedule rank = group rank)."""

    def __init__(self, schedule: Schedule, rank: int, group: dist.ProcessGroup | None) -> None:
        self.schedule, self.rank, self.group = schedule, rank, group
        self.received: dict[Key, _Pending] = {}
        self.sends: deque[tuple[int, Any]] = deque()  # (window, work)

    def peer(self, a: Action) -> int:
        """The rank at the other end of a send or receive."""
        forward = a.op in (Op.SEND_F, Op.RECV_B)
        s = self.schedule
        neighbour = s.next_stage(a.stage) if forward else s.prev_stage(a.stage)
        assert neighbour is not None, f"{a} has no peer stage"
        return s.stage_to_rank[neighbour]

    def post(self, a: Action, buffers: list[torch.Tensor]) -> None:
        """Post the receive `a` into `buffers`."""
        peer = self.peer(a)
        works = [dist.irecv(b, group=self.group, group_src=peer) for b in buffers]
        self.received[(a.op, a.stage, a.microbatch)] = _Pending(buffers, works)

    def take(self, key: Key) -> tuple[list[torch.Tensor], float]:
        """The data of a posted receive, waiting for it: (tensors, seconds waited)."""
        pending = self.received.pop(key)
        t = time.perf_counter()
        for work in pending.works:
            work.wait()
        return pending.buffers, time.perf_counter() - t

    def send(self, a: Action, tensors: list[torch.Tensor], window: int) -> None:
        """Start sending `tensors` (action `a` of window `window`)."""
        peer = self.peer(a)
        for t in tensors:
            work = dist.isend(t.contiguous(), group=self.group, group_dst=peer)
            self.sends.append((window, work))

    def settle(self, up_to: int) -> None:
        """Wait for the sends of windows up to `up_to` (their peers posted the receives)."""
        while self.sends and self.sends[0][0] <= up_to:
            self.sends.popleft()[1].wait()
