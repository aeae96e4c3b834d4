"""Replaying Wave Synchronous Parallel (Park et al., HetPipe, ATC 2020) over virtual workers:
when each one computes each wave, given its wave time, the exchange time and D.

The rule replayed is the runtime's (`plait.train.wsp`): worker i begins wave c once it
has finished wave c − 1 and the exchange of wave c − D − 1 has completed; the exchange of
wave c (an all-reduce over all workers) completes `exchange_s` after the last worker
finished wave c. D = 0 is bulk-synchronous over waves; with D ≥ 1 the exchange overlaps
the next waves, and a fast worker runs up to D waves ahead.

Each worker's wave time is its pipeline's simulated step (`plait.sim.replica`) ×
the steps per wave, a step being the pipelined compute and the slowest rank's optimizer
step (each worker updates its own weights every step; `wave_step_s`): the gradient
reduction is what the wave exchange replaces. Limits: wave times are constant, so in the
long run every worker goes at the slowest one's pace whatever D (D hides the exchange and
absorbs jitter, not a steady difference in speed: that is the batch shares' job); the
exchange has the whole link to itself (no contention with the pipelines' own messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["WaveReplay", "replay_wsp", "wave_step_s", "wsp_memory_bytes"]


@dataclass(frozen=True)
class WaveReplay:
    """When each worker began and ended each wave (seconds from the start)."""

    staleness: int
    exchange_s: float
    starts: tuple[tuple[float, ...], ...]  # [worker][wave]
    ends: tuple[tuple[float, ...], ...]

    @property
    def makespan_s(self) -> float:
        return max(e[-1] for e in self.ends)

    @property
    def seconds_per_wave(self) -> float:
        """The steady pace: the mean time between waves' completion by all, over whole
        cycles of D + 1 waves in the second half (the pace repeats every D + 1 waves)."""
        done = [max(e[c] for e in self.ends) for c in range(len(self.ends[0]))]
        cycle = self.staleness + 1
        span = cycle * (len(done) // 2 // cycle)
        if span == 0:
            return done[-1] / len(done)
        return (done[-1] - done[-1 - span]) / span

    def waiting_s(self, worker: int) -> float:
        """Seconds `worker` spent waiting for exchanges (idle between its waves)."""
        starts, ends = self.starts[worker], self.ends[worker]
        return starts[0] + sum(s - e for s, e in zip(starts[1:], ends[:-1], strict=True))


def wave_step_s(run: Any) -> float:
    """One step of a worker under WSP from its replica's replay (a `SimResult` or a
    `plait.sim.replica.ReplicaRun`): the pipelined compute and its slowest rank's
    optimizer step, without the gradient reduction the wave exchange replaces."""
    return float(run.pipeline_time_s + max(r.optimizer_s for r in run.ranks))


def replay_wsp(
    wave_s: Sequence[float], *, staleness: int, waves: int, exchange_s: float = 0.0
) -> WaveReplay:
    """The waves of workers that take `wave_s[i]` seconds a wave, under D = `staleness`."""
    if staleness < 0 or waves < 1 or not wave_s or min(wave_s) <= 0 or exchange_s < 0:
        raise ValueError(
            f"staleness={staleness}, waves={waves}, wave_s={list(wave_s)}, "
            f"exchange_s={exchange_s}: need D >= 0, waves >= 1, positive wave times"
        )
    n = len(wave_s)
    starts = [[0.0] * waves for _ in range(n)]
    ends = [[0.0] * waves for _ in range(n)]
    exchanged: list[float] = []  # completion of each wave's exchange
    for c in range(waves):
        due = c - staleness - 1
        for i in range(n):
            ready = ends[i][c - 1] if c else 0.0
            starts[i][c] = max(ready, exchanged[due]) if due >= 0 else ready
            ends[i][c] = starts[i][c] + wave_s[i]
        exchanged.append(max(ends[i][c] for i in range(n)) + exchange_s)
    return WaveReplay(staleness, exchange_s, tuple(map(tuple, starts)), tuple(map(tuple, ends)))


def wsp_memory_bytes(weight_bytes: float, staleness: int) -> float:
    """What WSP adds to a rank holding `weight_bytes` of weights: the snapshot at the
    start of the wave, and per wave not yet taken in (up to D + 1) its own update and the
    reduction's buffer (`plait.train.wsp.WaveExchange`)."""
    return weight_bytes * (1 + 2 * (staleness + 1))
