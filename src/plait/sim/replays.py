"""A replica's replay (and its ranks' walks), kept by what it reads: equal ones run once.

The planner simulates variants of one layout (ZeRO stages, recomputation, the lighter
recomputation it tries last) whose actions often take exactly the same times; a replay is a
pure function of the schedule, the times and the processors' sharing, and one of a
64-stage pipeline of 512 micro-batches takes seconds. A replay found here is the very
object a fresh one would equal, so nothing downstream can tell the difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from plait.schedule import Op, Replay, Schedule, Unrolled, replay, unroll
from plait.schedule.facts import ByStage
from plait.schedule.sharing import Sharing
from plait.sim.walk import Walk

__all__ = ["Read", "Times", "replayed", "walked"]

Times = dict[Op, list[float]]  # per op, the time of each stage's action
# a rank's read of a replay (`plait.sim.walk.walk`, or `walk_events` for tests)
Read = Callable[[int, Replay, Unrolled, int, Sequence[float], Sequence[float]], Walk]

# (schedule kept alive beside its id, unrolled run, replay) by `_key`
_KEPT: dict[tuple[object, ...], tuple[Schedule, Unrolled, Replay]] = {}
_LIMIT = 4
# (replay kept alive beside its id, each rank's walk) by the replay and what the walk reads
_WALKS: dict[tuple[object, ...], tuple[Replay, list[Walk]]] = {}


def _key(
    schedule: Schedule, windows: int, durations: Times, transfers: Times, sharing: Sharing | None
) -> tuple[object, ...]:
    # `repr` tells apart exactly the floats that differ (0.0 from -0.0 too): equal keys
    # give bit-identical replays
    times = repr([(op, durations[op]) for op in Op if op in durations])
    moves = repr([(op, transfers[op]) for op in Op if op in transfers])
    return (id(schedule), windows, times, moves, sharing)


def replayed(
    schedule: Schedule,
    windows: int,
    durations: Times,
    transfers: Times,
    sharing: Sharing | None,
) -> tuple[Unrolled, Replay]:
    """(`windows` windows of `schedule` unrolled, their replay) with each action of stage s
    taking `durations[op][s]` (sends `transfers[op][s]` on their channel)."""
    key = _key(schedule, windows, durations, transfers, sharing)
    kept = _KEPT.get(key)
    if kept is not None and kept[0] is schedule:
        return kept[1], kept[2]

    unrolled = unroll(schedule, windows)
    result = replay(
        unrolled.schedule,
        duration=ByStage(durations),
        transfer=ByStage(transfers),
        sharing=sharing,
    )
    if len(_KEPT) >= _LIMIT:
        _KEPT.clear()
    _KEPT[key] = (schedule, unrolled, result)
    return unrolled, result


def walked(
    read: Read,
    num_ranks: int,
    result: Replay,
    unrolled: Unrolled,
    first: int,
    saved: Sequence[float],
    copy: Sequence[float],
) -> list[Walk]:
    """`read(rank, result, unrolled, first, saved, copy)` of each rank (`plait.sim.walk`),
    kept with the replay: plans that share a replay and hold the same bytes (ZeRO stages
    that differ only in the optimizer state they shard) read the same walks."""
    key = (id(result), read, num_ranks, first, repr(list(saved)), repr(list(copy)))
    kept = _WALKS.get(key)
    if kept is None or kept[0] is not result:
        if len(_WALKS) >= _LIMIT:
            _WALKS.clear()
        walks = [read(rank, result, unrolled, first, saved, copy) for rank in range(num_ranks)]
        kept = _WALKS[key] = (result, walks)
    return [dataclasses.replace(w) for w in kept[1]]  # a Walk is mutable: each caller its own
