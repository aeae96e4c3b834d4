"""The validator: proves a schedule correct before anything runs, or shows where it breaks.

A schedule is a window of an unbounded stream (`plait.schedule.ir`). The validator first
checks the window itself: every action on the rank that owns its stage, no action on a
micro-batch of a later window, no derived weight-copy action, and every data dependency
running from a window to the same or a later one. It then checks concrete runs of 1 to
2·reach + 2 windows (`plait.schedule.stream.unroll`), which cover every way the warm-up
and the drain can meet: every micro-batch has exactly one forward and one backward (full,
or BI then BW) on every stage of its path; each rank orders its own actions legally;
every cross-rank boundary has exactly one send and one receive, posted on each directed
channel in the order of the sends (so in-order transports such as NCCL match them); the
weight versions obey the schedule's policy (`plait.schedule.versions`); and abstract
execution (`replay`) finishes.

Why that proves any number of windows: the dependencies of the unbounded stream run from
a window to the same or a later one, so a cycle (a deadlock) would lie within one window,
and a run of 2·reach + 2 windows holds a whole steady window; a shorter or longer run is
the stream restricted to fewer micro-batches, whose dependencies are a subset. Versions,
messages and channel orders repeat with the window, shifted.

The checks of a run's structure live in `plait.schedule.checks`; the version rules in
`plait.schedule.versions`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass

from plait.schedule.checks import (
    ScheduleError,
    check_coverage,
    check_local_order,
    check_messages,
    check_range,
    fail,
    first_message,
    ids,
    missing,
)
from plait.schedule.grid import format_grid
from plait.schedule.ir import COMPUTE_OPS, P2P_OPS, WEIGHT_OPS, Action, Op, Schedule
from plait.schedule.lower import stream_deadlock
from plait.schedule.replay import Replay, replay, unit_summary
from plait.schedule.stream import Unrolled, unroll
from plait.schedule.versions import VersionError, WeightPlanner

__all__ = ["ScheduleError", "ValidationReport", "validate"]


@dataclass(frozen=True)
class ValidationReport:
    """What validation learned under unit costs (forward 1, backward 2).

    For an asynchronous schedule `makespan` and `bubble_fraction` are those of a run of
    one window (warm-up and drain); `window_time` is the steady-state time per window.
    """

    peak_inflight: tuple[int, ...]  # per rank: most micro-batches whose activations it holds
    makespan: float
    bubble_fraction: float  # idle share of ranks × makespan
    window_time: float = 0.0
    peak_weight_versions: tuple[int, ...] = ()  # per rank: most distinct versions alive
    peak_weight_copies: tuple[int, ...] = ()  # per rank: most copies besides the live ones


# ------------------------------------------------------------------ the window
def _check_window(schedule: Schedule) -> None:
    """Placement, micro-batch range and derived actions of the window's own program."""
    place, m = schedule.stage_to_rank, schedule.num_microbatches
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            if a.stage >= schedule.num_stages:
                raise fail(schedule, rank, index, f"stage {a.stage} >= {schedule.num_stages}")
            if place[a.stage] != rank:
                raise fail(
                    schedule, rank, index, f"stage {a.stage} is placed on rank {place[a.stage]}"
                )
            if a.microbatch >= m:
                raise fail(
                    schedule, rank, index, f"micro-batch {a.microbatch} is not in this window "
                    f"(0..{m - 1}) nor an earlier one: a window runs no later micro-batch",
                )  # fmt: skip
            if a.op in WEIGHT_OPS and schedule.reach > 0:
                raise fail(schedule, rank, index, "weight copies are derived: remove it")
            if a.op in COMPUTE_OPS and schedule.policy == "sync" and a.version not in (None, 0):
                raise fail(schedule, rank, index, "a 'sync' window computes on its version 0")
    counts = Counter(a.stage for p in schedule.ranks for a in p if a.op is Op.UPDATE)
    if (counts and len(set(counts.values())) > 1) or (counts and len(counts) < schedule.num_stages):
        per = {s: counts.get(s, 0) for s in range(schedule.num_stages)}
        raise missing(
            schedule, 0, f"stages update a different number of times per window ({per}): "
            "give every stage the same number of UPDATEs",
        )  # fmt: skip
    _check_lags(schedule)


def _check_lags(schedule: Schedule) -> None:
    """Each data dependency runs from a window to the same or a later one: the window in
    which an action runs, relative to its micro-batch's, is at least its producer's."""
    m = schedule.num_microbatches
    lag: dict[tuple[Op, int, int], tuple[int, int, int]] = {}
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            if a.op in COMPUTE_OPS:
                lag[(a.op, a.stage, a.microbatch % m)] = (-(a.microbatch // m), rank, index)
    for (op, stage, mb), (mine, rank, index) in lag.items():
        if op is Op.F:
            producers = [(Op.F, schedule.prev_stage(stage))]
        elif op is Op.BW:
            producers = [(Op.BI, stage)]
        else:
            later = schedule.next_stage(stage)
            producers = [(Op.F, stage), (Op.B, later), (Op.BI, later)]
        for p_op, p_stage in producers:
            found = lag.get((p_op, p_stage, mb)) if p_stage is not None else None
            if found is not None and found[0] > mine:
                raise fail(
                    schedule, rank, index, f"runs {found[0] - mine} window(s) before the "
                    f"{p_stage}{p_op.value} it needs: a window may only use data of its own "
                    "or earlier windows",
                )  # fmt: skip


# ------------------------------------------------------------------ versions
def _facts(run: Schedule) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """Facts across ranks the version rules need: the version each micro-batch's forward
    used on its first stage, and the version each (stage, micro-batch) gradient is applied
    to (the version before the first UPDATE of the stage after its last backward)."""
    first: dict[int, int] = {}
    applied: dict[tuple[int, int], int] = {}
    for program in run.ranks:
        waiting: dict[int, list[int]] = defaultdict(list)  # stage -> micro-batches done
        count: Counter[int] = Counter()
        for a in program:
            if a.op is Op.F and a.version is not None and run.is_first(a.stage):
                first[a.microbatch] = a.version
            elif a.op in (Op.B, Op.BW):
                waiting[a.stage].append(a.microbatch)
            elif a.op is Op.UPDATE:
                for x in waiting.pop(a.stage, []):
                    applied[(a.stage, x)] = count[a.stage]
                count[a.stage] += 1
    return first, applied


def _check_sync(run: Schedule) -> None:
    """A synchronous run updates a stage only when none of its micro-batches is in flight,
    and its k-th UPDATE produces version k."""
    for rank, program in enumerate(run.ranks):
        inflight: Counter[int] = Counter()
        count: Counter[int] = Counter()
        for index, a in enumerate(program):
            if a.op is Op.F:
                inflight[a.stage] += 1
            elif a.op is Op.B or a.op is Op.BW:
                inflight[a.stage] -= 1
            elif a.op is Op.UPDATE:
                count[a.stage] += 1
                if inflight[a.stage]:
                    why = (
                        f"updates stage {a.stage} while {inflight[a.stage]} of its micro-batches "
                        "are in flight: a synchronous schedule updates after their backwards"
                    )
                    raise fail(run, rank, index, why)
                if a.version is not None and a.version != count[a.stage]:
                    why = f"is update {count[a.stage]} of stage {a.stage}: it produces that version"
                    raise fail(run, rank, index, why)


@dataclass(frozen=True)
class _Planned:
    schedule: Schedule  # the run with its weight copies
    starts: tuple[tuple[int, ...], ...]  # per rank: where each window (then the drain) begins
    versions: tuple[int, ...]  # per rank: peak distinct versions alive
    copies: tuple[int, ...]  # per rank: peak copies alive besides the live weights


def _plan_versions(unrolled: Unrolled) -> _Planned:
    """Check the run's versions against its policy while planning its weight copies, one
    window at a time as the runtime does (with the whole rest of the run as look-ahead)."""
    run = unrolled.schedule
    if run.policy == "sync":
        _check_sync(run)
        ones = tuple(1 for _ in run.ranks)
        return _Planned(run, unrolled.starts, ones, tuple(0 for _ in run.ranks))
    first, applied = _facts(run)
    programs, starts, versions, copies = [], [], [], []
    for rank, program in enumerate(run.ranks):
        limit = 2 if run.policy == "2bw" else None
        planner = WeightPlanner(
            run.policy, first_version=first, applied=applied, max_versions=limit
        )
        marks, planned = unrolled.starts[rank], list[Action]()
        new_marks = []
        for w in range(len(marks)):
            begin = marks[w]
            end = marks[w + 1] if w + 1 < len(marks) else len(program)
            new_marks.append(len(planned))
            try:
                planned += planner.plan(program[begin:end], program[end:])
            except VersionError as err:
                raise fail(run, rank, begin + err.index, err.why) from None
        planned += planner.free_all()
        programs.append(planned)
        starts.append(tuple(new_marks))
        versions.append(max(planner.peak_versions.values(), default=1))
        copies.append(planner.peak_copies)
    return _Planned(run.with_programs(programs), tuple(starts), tuple(versions), tuple(copies))


def window_ends(result: Replay, starts: tuple[tuple[int, ...], ...]) -> list[float]:
    """When each window of a replayed run ends: its last action's end on any rank."""
    windows = len(starts[0]) - 1
    ends = [0.0] * windows
    for rank, events in enumerate(result.events):
        marks = starts[rank]
        for e in events:  # by index: a compute-only replay's sends carry their producer's
            w = bisect_right(marks, e.index) - 1
            if w < windows and e.end > ends[w]:
                ends[w] = e.end
    return ends


# ------------------------------------------------------------------- driver
def _check_run(
    schedule: Schedule, num_windows: int, *, streams: bool = True
) -> tuple[_Planned, ValidationReport]:
    unrolled = unroll(schedule, num_windows, plan=False)
    run = unrolled.schedule
    check_range(run)
    numbers = ids(run)
    check_coverage(run, numbers)
    check_local_order(run, numbers)
    lowest = first_message(run)
    messages = [[i for i in program_ids if i >= lowest] for program_ids in numbers]
    if any(messages):
        check_messages(run, messages)
    planned = _plan_versions(unrolled)
    summary = unit_summary(planned.schedule)
    if not summary.completed:
        result = replay(planned.schedule)  # again, with events, to draw the grid
        mark = frozenset((b.rank, b.index) for b in result.blocked)
        stuck = "; ".join(
            f"rank {b.rank} at {b.action} waits for {b.waiting_for}" for b in result.blocked
        )
        grid = format_grid(planned.schedule, result=result, mark=mark)
        raise ScheduleError(f"{schedule.kind}: deadlock: {stuck}\n{grid}")
    # the runtime's lowered programs under NCCL's rule, once the schedule itself is proven
    # (its own errors name the culprit better), and where it says how messages go
    has_messages = streams and any(a.op in P2P_OPS for program in run.ranks for a in program)
    stuck_streams = stream_deadlock(run) if has_messages else None
    if stuck_streams is not None:
        raise ScheduleError(
            f"{schedule.kind}: its lowered programs deadlock on NCCL streams: {stuck_streams}"
        )
    span = summary.makespan
    busy = sum(summary.busy)
    bubble = 1.0 - busy / (span * run.num_ranks) if span else 0.0
    window = span
    steady = schedule.reach + 1  # the first window the warm-up leaves whole
    if num_windows > steady:
        ends = window_ends(replay(planned.schedule), planned.starts)
        window = (ends[-1] - ends[steady - 1]) / (num_windows - steady)
    report = ValidationReport(
        summary.peak_inflight, span, bubble, window, planned.versions, planned.copies
    )
    return planned, report


def validate(schedule: Schedule) -> ValidationReport:
    """Prove `schedule` correct or raise `ScheduleError` with the grid, culprit marked."""
    _check_window(schedule)
    if schedule.reach == 0 and schedule.policy == "sync":
        return _check_run(schedule, 1)[1]
    longest = max(2 * schedule.reach + 2, 3)  # at least one steady window between the ends
    # the stream rule once, on the longest run: a shorter run's dependencies are a subset
    reports = [_check_run(schedule, k, streams=k == longest)[1] for k in range(1, longest + 1)]
    first, last = reports[0], reports[-1]
    return ValidationReport(
        tuple(max(r.peak_inflight[i] for r in reports) for i in range(schedule.num_ranks)),
        first.makespan,
        first.bubble_fraction,
        last.window_time,
        tuple(max(r.peak_weight_versions[i] for r in reports) for i in range(schedule.num_ranks)),
        tuple(max(r.peak_weight_copies[i] for r in reports) for i in range(schedule.num_ranks)),
    )
