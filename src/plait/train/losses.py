"""The exchange of each window's micro-batch losses among all workers (`LossExchange`)."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.config import ParallelPlan
from plait.runtime import StepResult
from plait.schedule import Schedule
from plait.wait import timed_wait, timeout_message

__all__ = ["LossExchange"]


class LossExchange:
    """Every finished micro-batch's global id and loss, on every rank. Only the ranks of
    last stages have them: one all-reduce over all workers sums them (each tensor- and
    data- and context-parallel replica counts 1/(dp·cp·tp), so data-parallel losses, and
    the equal-sized sequence shards of context parallelism, are averaged).

    A synchronous window's losses are exchanged at its end (its UPDATEs synchronised the
    workers anyway). An asynchronous stream must not wait: its stages run windows apart,
    so a window's reduction is started at its end and collected `lag` windows later (or
    at the drain), when every worker has long passed that window.
    """

    def __init__(
        self, plan: ParallelPlan, schedule: Schedule, device: torch.device,
        timeout_s: float | None,
    ) -> None:  # fmt: skip
        self.device, self.m, self.reach = device, plan.microbatches, schedule.reach
        self.weight = 1.0 / (plan.dp * plan.cp * plan.tp)
        self.timeout_s = timeout_s
        self.lag = 0 if schedule.policy == "sync" else schedule.reach + 1
        self.pending: deque[tuple[int, Any, torch.Tensor, int]] = deque()
        self.reduced = dist.get_world_size() > 1

    def exchange(
        self, windows: int, result: StepResult, *, last: bool, extra: Sequence[torch.Tensor] = ()
    ) -> tuple[tuple[int, ...], tuple[float, ...], list[float]]:
        """Start the reduction of `result`'s losses (after `windows` windows); return the
        losses whose reduction is due now (all of them when `last`), and the values of the
        `extra` tensors (one element each), read in the same copy to the host."""
        first = (windows - 1 - self.reach) * self.m  # ids span the window and `reach` before
        span = (self.reach + 1) * self.m
        values = torch.zeros(2 * span, device=self.device)
        for x, loss in zip(result.microbatches, result.losses, strict=True):
            values[x - first] = loss.to(self.device) * self.weight
            values[span + x - first] = self.weight
        # one worker holds every loss already (a collective of one still costs milliseconds)
        work = dist.all_reduce(values, async_op=True) if self.reduced else None
        self.pending.append((windows, work, values, first))
        due: list[tuple[torch.Tensor, int]] = []
        while self.pending and (last or self.pending[0][0] <= windows - self.lag):
            started, work, values, first = self.pending.popleft()
            if work is not None:
                timed_wait(work, self.timeout_s, functools.partial(self._explain, started))
            due.append((values, first))
        parts = [v for v, _ in due] + [t.reshape(1).to(self.device, torch.float32) for t in extra]
        host = torch.cat(parts).tolist() if parts else []  # the step's one host read
        found: list[tuple[int, float]] = []
        for k, (_, first) in enumerate(due):
            row = host[2 * span * k : 2 * span * (k + 1)]
            found += [(first + i, v) for i, (v, c) in enumerate(zip(row[:span], row[span:],
                      strict=True)) if c > 0.5]  # fmt: skip
        rest = host[2 * span * len(due) :]
        return tuple(x for x, _ in found), tuple(v for _, v in found), rest

    def _explain(self, windows: int) -> str:
        """Why the wait for the losses reduced after `windows` windows timed out."""
        assert self.timeout_s is not None
        return timeout_message(
            f"rank {dist.get_rank()}",
            f"the loss exchange of window {windows - 1}",
            self.timeout_s,
            "the all-reduce of the losses over every rank",
            peers=dist.get_world_size() - 1,
        )
