"""The stream of windows: a schedule's program turned into the concrete actions a rank runs.

A `Schedule` is the program of window 0 (see `plait.schedule.ir`). Window i is that
program with micro-batch ids raised by ``i·m`` and versions by ``i·u``; an action on a
micro-batch below 0 (one from before the stream began) is not run, and a version below 0
is the initial weights, version 0. After the last window, the drain runs what the
following windows would have run for micro-batches already begun, so a run of n windows
is exactly the unbounded stream restricted to the micro-batches ``0..n·m-1``: warm-up,
steady state and drain all come from one window's program.

`RankStream` yields one rank's concrete windows, with the weight-copy actions of
`plait.schedule.versions` planned against a look-ahead of the windows that follow; the
runtime executes them. `unroll` builds every rank's whole run of n windows as one closed
schedule, which the validator, the replay and the simulator take.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.schedule.ir import WEIGHT_OPS, Action, Op, Schedule
from plait.schedule.versions import WeightPlanner

__all__ = ["RankStream", "Unrolled", "concrete_window", "unroll"]


def concrete_window(
    schedule: Schedule, rank: int, window: int, *, end: int | None = None
) -> list[Action]:
    """Rank `rank`'s actions of window `window` in global ids, without weight copies; with
    `end`, actions on micro-batches at or beyond it are left out (the drain)."""
    m, u = schedule.num_microbatches, schedule.updates_per_window
    base, shift = window * m, window * u
    out = []
    for a in schedule.ranks[rank]:
        x = a.microbatch + base
        if x < 0 or (end is not None and x >= end):
            continue
        v = a.version
        if v is not None:
            v += shift
            if v < 0 and a.op is not Op.UPDATE:
                v = 0
        out.append(a if (x, v) == (a.microbatch, a.version) else Action(a.op, a.stage, x, v))
    return out


class RankStream:
    """Rank `rank`'s concrete program of `schedule`, one window per `window()` call, then
    `drain()`. Weight copies are planned with a look-ahead of `reach + 2` windows, enough
    for every use of a copy (a micro-batch spans at most `reach + 1` windows)."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.schedule, self.rank = schedule, rank
        self.horizon = schedule.reach + 2
        self.planner = WeightPlanner(schedule.policy) if schedule.policy != "sync" else None
        self.windows = 0  # windows emitted so far
        self.drained = False
        self._cache: dict[int, list[Action]] = {}

    def _window(self, index: int) -> list[Action]:
        if index not in self._cache:
            self._cache[index] = concrete_window(self.schedule, self.rank, index)
        return self._cache[index]

    def window(self) -> tuple[Action, ...]:
        """The next window's actions."""
        if self.drained:
            raise RuntimeError("the stream was drained: build a new RankStream to start again")
        i = self.windows
        actions = self._window(i)
        if self.planner is not None:
            ahead = [a for j in range(i + 1, i + 1 + self.horizon) for a in self._window(j)]
            actions = self.planner.plan(actions, ahead)
        self._cache.pop(i, None)
        self.windows += 1
        return tuple(actions)

    def drain(self) -> tuple[Action, ...]:
        """What is left of micro-batches already begun; the stream ends."""
        if self.drained:
            return ()
        self.drained = True
        end = self.windows * self.schedule.num_microbatches
        actions = [
            a
            for j in range(self.windows, self.windows + self.schedule.reach + 1)
            for a in concrete_window(self.schedule, self.rank, j, end=end)
        ]
        self._cache.clear()
        if self.planner is None:
            return tuple(actions)
        return tuple(self.planner.plan(actions) + self.planner.free_all())


@dataclass(frozen=True)
class Unrolled:
    """A run of `num_windows` windows as one closed schedule (ids 0..n·m-1), and where in
    each rank's program window i begins (`starts[r][i]`; `starts[r][n]` is the drain)."""

    schedule: Schedule
    starts: tuple[tuple[int, ...], ...]
    num_windows: int

    def window_of(self, rank: int, index: int) -> int:
        """The window program index `index` of `rank` belongs to (n: the drain)."""
        starts = self.starts[rank]
        window = 0
        while window < self.num_windows and starts[window + 1] <= index:
            window += 1
        return window


def unroll(schedule: Schedule, num_windows: int = 1, *, plan: bool = True) -> Unrolled:
    """`num_windows` windows of `schedule` and the drain, per rank, as the runtime runs
    them; `plan=False` leaves out the weight copies (what the validator checks first)."""
    if num_windows < 1:
        raise ValueError(f"num_windows={num_windows}: unroll at least one window")
    closed_form = isinstance(schedule.ranks, tuple) and all(
        isinstance(p, tuple) for p in schedule.ranks
    )
    if closed_form and num_windows == 1 and schedule.policy == "sync" and schedule.reach == 0:
        # a synchronous step is its own run (immutable: the same object, whose facts a
        # replay keeps); the checks below could not refuse it
        return Unrolled(schedule, tuple((0, len(p)) for p in schedule.ranks), 1)
    planned = any(a.op in WEIGHT_OPS for p in schedule.ranks for a in p)
    if planned and (num_windows > 1 or schedule.reach > 0):
        raise ValueError(
            "this program already holds weight copies (STASH/PREDICT/FREE): it is a whole "
            "run, not a window; unroll the schedule it came from instead"
        )
    if schedule.reach == 0 and num_windows == 1 and (schedule.policy == "sync" or planned):
        closed = schedule.with_programs(schedule.ranks)
        return Unrolled(closed, tuple((0, len(p)) for p in schedule.ranks), 1)
    programs: list[list[Action]] = []
    starts: list[tuple[int, ...]] = []
    for rank in range(schedule.num_ranks):
        stream = RankStream(schedule, rank)
        if not plan:
            stream.planner = None
        program: list[Action] = []
        marks = []
        for _ in range(num_windows):
            marks.append(len(program))
            program += stream.window()
        marks.append(len(program))
        program += stream.drain()
        programs.append(program)
        starts.append(tuple(marks))
    closed = Schedule(
        kind=schedule.kind,
        num_ranks=schedule.num_ranks,
        num_microbatches=num_windows * schedule.num_microbatches,
        stage_to_rank=schedule.stage_to_rank,
        ranks=tuple(tuple(p) for p in programs),
        num_chunks=schedule.num_chunks,
        policy=schedule.policy,
        pipelines=schedule.pipelines,
    )
    return Unrolled(closed, tuple(starts), num_windows)
