"""Ranks time-sharing processors: the policy `plait.schedule.replay` runs under `sharing=`.

`replay` lets each rank run ahead as far as its data allows, which is exact when every
rank computes on its own device. When several ranks share one processor (CPU workers
outnumbering the cores they are pinned to), how fast a rank computes depends on who else
is computing at that moment, so the replay advances one global clock instead and shares
each processor equally among the compute actions running on it (processor sharing,
Kleinrock 1967): a compute action of `duration(rank, action)` seconds of work runs at
speed min(1, 1 / load), where load counts the ranks computing on its processor. Everything
else (program order, data dependencies, asynchronous sends on FIFO channels, posted
receives) is the replay's own: this module only says when shared compute finishes.

`Sharing.load` lets one replayed rank stand for several processes that run in lockstep (the
same pipeline rank in other data-parallel replicas, or its tensor-parallel peers): each
counts when the rank it copies is computing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["SharedProcessors", "Sharing", "fit_efficiency"]

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


class SharedProcessors:
    """The compute actions running on time-shared processors, for `replay`'s one clock:
    each started with its work in seconds, each progressing at the speed its processor's
    load leaves it (processor sharing)."""

    def __init__(self, sharing: Sharing, num_ranks: int) -> None:
        if len(sharing.processor) != num_ranks:
            raise ValueError(
                f"sharing names {len(sharing.processor)} ranks for a schedule of "
                f"{num_ranks}: give one processor per rank"
            )
        self.sharing = sharing
        self.remaining: dict[int, float] = {}  # computing rank -> seconds of work left
        self.started: dict[int, float] = {}

    @property
    def running(self) -> bool:
        return bool(self.remaining)

    def start(self, rank: int, work: float, now: float) -> None:
        self.remaining[rank], self.started[rank] = work, now

    def _speeds(self) -> dict[int, float]:
        load = [sum(row[r] for r in self.remaining) for row in self.sharing.load]
        return {r: self.sharing.speed(load[self.sharing.processor[r]]) for r in self.remaining}

    def next_finish(self, now: float) -> float:
        """When the first running action finishes at today's speeds (inf: none runs)."""
        speeds = self._speeds()
        return min((now + self.remaining[r] / v for r, v in speeds.items()), default=math.inf)

    def advance(self, now: float, until: float) -> list[tuple[int, float]]:
        """Run from `now` to `until`; the ranks whose action finished, with its start."""
        for r, v in self._speeds().items():
            self.remaining[r] -= v * (until - now)
        tolerance = _EPS * max(1.0, until)
        done = sorted(r for r, left in self.remaining.items() if left <= tolerance)
        for r in done:
            del self.remaining[r]
        return [(r, self.started.pop(r)) for r in done]


def fit_efficiency(predict: Callable[[float], float], measured_s: float) -> float:
    """The efficiency in [0.2, 1] under which `predict(efficiency)` (a predicted time, which
    falls as efficiency rises) equals `measured_s`, by bisection; a bound when none does."""
    low, high = 0.2, 1.0
    for _ in range(16):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(mid) > measured_s else (low, mid)
    return (low + high) / 2
