"""Abstract execution when ranks time-share processors: `replay`'s semantics, in time order.

`plait.schedule.replay` lets each rank run ahead as far as its data allows, which is exact
when every rank computes on its own device. When several ranks share one processor (CPU
workers outnumbering the cores they are pinned to), how fast a rank computes depends on
who else is computing at that moment, so this interpreter advances one global clock
instead and shares each processor equally among the compute actions running on it
(processor sharing, Kleinrock 1967): a compute action of `duration(rank, action)` seconds
of work runs at speed min(1, 1 / load), where load counts the ranks computing on its
processor. Everything else (program order, data dependencies, asynchronous sends on FIFO
channels, posted receives) is `replay`'s, through the same compiled templates.

`Sharing.load` lets one replayed rank stand for several processes that run in lockstep (the
same pipeline rank in other data-parallel replicas, or its tensor-parallel peers): each
counts when the rank it copies is computing.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from plait.schedule.facts import COMPUTE, REDUCE, SEND
from plait.schedule.ir import Schedule
from plait.schedule.replay import (
    Duration,
    Replay,
    _gc_paused,
    _Machine,
    _no_transfer,
    unit_duration,
)
from plait.schedule.stream import unroll

__all__ = ["Sharing", "fit_efficiency", "replay_shared"]

_EPS = 1e-12


@dataclass(frozen=True)
class Sharing:
    """Which processor each rank computes on, and what loads each processor.

    `processor[r]` is rank r's processor; `load[p][r]` is how many processes computing in
    step with rank r run on processor p (0 or 1 for plain ranks, more for lockstep copies).
    `efficiency`: the share of its speed a processor keeps while processes time-share it
    (context switches and cache refills cost the rest); each of n > 1 runs at efficiency/n.
    """

    processor: tuple[int, ...]
    load: tuple[tuple[int, ...], ...]
    efficiency: float = 1.0

    @classmethod
    def of(cls, processor: Sequence[int], efficiency: float = 1.0) -> Sharing:
        """Ranks on the given processors, one process each (`processor[r]` any integer)."""
        ids = sorted(set(processor))
        index = [ids.index(p) for p in processor]
        load = tuple(tuple(int(index[r] == p) for r in range(len(index))) for p in range(len(ids)))
        return cls(tuple(index), load, efficiency)

    def speed(self, load: int) -> float:
        """The speed of each of `load` processes computing on one processor."""
        return 1.0 if load <= 1 else self.efficiency / load

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(
                f"efficiency={self.efficiency} must be in (0, 1]: the share of a processor's "
                "speed that processes time-sharing it keep"
            )
        n = len(self.processor)
        if any(not 0 <= p < len(self.load) for p in self.processor):
            raise ValueError(f"processors {self.processor} must index the {len(self.load)} loads")
        if any(len(row) != n or min(row, default=0) < 0 for row in self.load):
            raise ValueError(f"each load row needs {n} counts >= 0, one per rank")
        for r, p in enumerate(self.processor):
            if self.load[p][r] < 1:
                raise ValueError(f"rank {r} runs on processor {p} but load[{p}][{r}] is 0")


class _SharedMachine(_Machine):
    """`_Machine` driven by a global clock; compute actions progress at shared speed."""

    def __init__(
        self, schedule: Schedule, duration: Duration, transfer: Duration, sharing: Sharing
    ) -> None:
        super().__init__(schedule, duration, transfer)
        if len(sharing.processor) != schedule.num_ranks:
            raise ValueError(
                f"sharing names {len(sharing.processor)} ranks for a schedule of "
                f"{schedule.num_ranks}: give one processor per rank"
            )
        self.sharing = sharing
        self.now = 0.0
        self.timers: list[tuple[float, int]] = []  # (when, rank): data lands at `when`
        self.remaining: dict[int, float] = {}  # computing rank -> seconds of work left
        self.started: dict[int, float] = {}

    def run_rank(self, rank: int) -> None:
        """Run `rank` from the clock until it computes, waits for data, or ends."""
        program, times, now = self.s.ranks[rank], self.times, self.now
        by_stage = self.templates[rank]
        while self.pc[rank] < len(program):
            a = program[self.pc[rank]]
            m = a.microbatch
            t = by_stage[a.stage].get(a.op) or self._template(rank, a)
            ready = 0.0
            for base in t.needs:
                when = times[base + m]
                if when is None:
                    self.waiting[rank] = base + m
                    self.waiters.setdefault(base + m, []).append(rank)
                    return
                ready = max(ready, when)
            if t.lag is not None and self.transfer is not _no_transfer:
                ready = self._lagged(t, m)
            if ready > now + _EPS:  # its data is still on the wire
                heapq.heappush(self.timers, (ready, rank))
                return
            if t.code == COMPUTE:
                work = t.unit if self.duration is unit_duration else self.duration(rank, a)
                self.remaining[rank], self.started[rank] = work, now
                return
            start = end = now
            if t.code == SEND:  # from when its data exists, as in `replay`
                channel = t.channel
                start = max(ready, self.channel_free[channel])
                end = self.channel_free[channel] = start + self.transfer(rank, a)
            elif t.code == REDUCE:  # from when the rank reaches it
                channel = t.channel
                start = max(now, self.channel_free[channel])
                end = self.channel_free[channel] = start + self.duration(rank, a)
            self._finish(rank, start, end)

    def _finish(self, rank: int, start: float, end: float) -> None:
        a = self.s.ranks[rank][self.pc[rank]]
        t = self.templates[rank][a.stage].get(a.op) or self._template(rank, a)
        if t.code == COMPUTE:
            self.busy[rank] += end - start
            self.inflight[rank] += t.delta
            self.peak[rank] = max(self.peak[rank], self.inflight[rank])
        if t.publish >= 0:
            fact = t.publish + a.microbatch
            self.times[fact] = end
            self.wake.extend(self.waiters.pop(fact, ()))
        self.starts[rank].append(start)
        self.ends[rank].append(end)
        self.pc[rank] += 1
        self.clock[rank] = end

    def _speeds(self) -> dict[int, float]:
        load = [0] * len(self.sharing.load)
        for p, row in enumerate(self.sharing.load):
            load[p] = sum(row[r] for r in self.remaining)
        return {r: self.sharing.speed(load[self.sharing.processor[r]]) for r in self.remaining}

    def execute(self) -> None:
        self.wake = deque(range(self.s.num_ranks))
        while True:
            while self.wake:
                rank = self.wake.popleft()
                self.waiting.pop(rank, None)
                self.run_rank(rank)
            if not self.remaining and not self.timers:
                return
            speeds = self._speeds()
            done = min(
                (self.now + self.remaining[r] / v for r, v in speeds.items()), default=float("inf")
            )
            until = min(done, self.timers[0][0] if self.timers else float("inf"))
            for r, v in speeds.items():
                self.remaining[r] -= v * (until - self.now)
            self.now = until
            tolerance = _EPS * max(1.0, until)
            for r in sorted(r for r, left in self.remaining.items() if left <= tolerance):
                del self.remaining[r]
                self._finish(r, self.started.pop(r), until)
                self.wake.append(r)
            while self.timers and self.timers[0][0] <= until + _EPS:
                self.wake.append(heapq.heappop(self.timers)[1])


def replay_shared(
    schedule: Schedule,
    sharing: Sharing,
    *,
    duration: Duration = unit_duration,
    transfer: Duration = _no_transfer,
    windows: int = 1,
) -> Replay:
    """Execute `windows` windows of `schedule` abstractly with ranks time-sharing processors
    as `sharing` says; `duration` is each compute action's work in seconds on a processor
    of its own."""
    with _gc_paused():
        concrete = unroll(schedule, windows).schedule
        machine = _SharedMachine(concrete, duration, transfer, sharing)
        machine.execute()
        return machine.result()


def fit_efficiency(predict: Callable[[float], float], measured_s: float) -> float:
    """The efficiency in [0.2, 1] under which `predict(efficiency)` (a predicted time, which
    falls as efficiency rises) equals `measured_s`, by bisection; a bound when none does."""
    low, high = 0.2, 1.0
    for _ in range(16):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(mid) > measured_s else (low, mid)
    return (low + high) / 2
