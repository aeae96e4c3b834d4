"""Kept replays (`plait.sim.replays`): equal inputs share one replay, any other time replays."""

from __future__ import annotations

import pytest

from plait.schedule import Op, build, replay, unroll
from plait.sim.replays import Times, replayed, walked
from plait.sim.walk import walk


def _times(p: int, forward: float = 1.0) -> tuple[Times, Times]:
    n = 2 * p
    durations = {Op.F: [forward] * n, Op.B: [2.0] * n, Op.BI: [1.0] * n, Op.BW: [1.0] * n,
                 Op.REDUCE: [0.5] * n, Op.UPDATE: [0.25] * n}  # fmt: skip
    return durations, {Op.SEND_F: [0.1] * n, Op.SEND_B: [0.1] * n}


@pytest.mark.parametrize(("kind", "p", "m"), [("zb-v", 3, 7), ("zb-v", 4, 8)])
def test_a_kept_replay_is_the_fresh_one(kind: str, p: int, m: int) -> None:
    schedule = build(kind, p, m)
    durations, transfers = _times(p)
    _, first = replayed(schedule, 1, durations, transfers, None)
    _, again = replayed(schedule, 1, _times(p)[0], _times(p)[1], None)
    assert again is first
    fresh = replay(
        unroll(schedule, 1).schedule,
        duration=lambda r, a: durations[a.op][a.stage],
        transfer=lambda r, a: transfers[a.op][a.stage],
    )
    assert (fresh.starts, fresh.ends, fresh.peak_inflight) == (
        first.starts,
        first.ends,
        first.peak_inflight,
    )


def test_other_times_replay_anew() -> None:
    schedule = build("zb-v", 3, 6)
    _, first = replayed(schedule, 1, *_times(3), None)
    _, slower = replayed(schedule, 1, *_times(3, forward=1.5), None)
    _, signed = replayed(schedule, 1, *_times(3, forward=-0.0), None)
    _, unsigned = replayed(schedule, 1, *_times(3, forward=0.0), None)
    assert slower is not first and max(map(max, slower.ends)) > max(map(max, first.ends))
    assert signed is not unsigned  # -0.0 == 0.0, yet not the same input


def test_kept_walks_are_fresh_walks_each_caller_its_own() -> None:
    schedule = build("zb-v", 3, 6)
    unrolled, result = replayed(schedule, 1, *_times(3), None)
    saved, copy = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0.5] * 6
    first = walked(walk, 3, result, unrolled, 0, saved, copy)
    again = walked(walk, 3, result, unrolled, 0, list(saved), list(copy))
    assert again == first and all(a is not b for a, b in zip(again, first, strict=True))
    assert first == [walk(r, result, unrolled, 0, saved, copy) for r in range(3)]
    heavier = walked(walk, 3, result, unrolled, 0, [2 * x for x in saved], copy)
    assert heavier[0].activation_peak > first[0].activation_peak
