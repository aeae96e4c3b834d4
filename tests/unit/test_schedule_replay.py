"""Replay's semantics on hand-computed timelines: data waits, channels, memory, blocking."""

from __future__ import annotations

import pytest

from plait.schedule import (
    Action,
    Op,
    Replay,
    add_reductions,
    build,
    compute_only,
    one_f_one_b,
    replay,
    unit_duration,
    zero_bubble_h1,
)
from plait.schedule.replay import unit_summary


def timeline(result: Replay, rank: int) -> dict[str, tuple[float, float]]:
    return {str(e.action): (e.start, e.end) for e in result.events[rank]}


def half(rank: int, action: Action) -> float:
    del rank, action
    return 0.5


def test_unit_durations() -> None:
    durations = {op: unit_duration(0, Action(op, 0, 0)) for op in Op}
    assert durations[Op.F] == 1.0 and durations[Op.B] == 2.0
    assert durations[Op.BI] == durations[Op.BW] == 1.0
    assert durations[Op.SEND_F] == durations[Op.RECV_B] == 0.0


def test_messages_take_their_transfer_time() -> None:
    result = replay(build("1f1b", 2, 2), transfer=half)
    assert timeline(result, 0) == {
        "0F0": (0.0, 1.0),
        "0SEND_F0": (1.0, 1.5),  # a send's end is the arrival at the peer
        "0RECV_B0": (1.0, 1.0),  # a receive only posts, at the rank's clock
        "0F1": (1.0, 2.0),
        "0SEND_F1": (2.0, 2.5),
        "0RECV_B1": (2.0, 2.0),
        "0B0": (5.0, 7.0),  # waits for 1SEND_B0 to arrive
        "0B1": (8.0, 10.0),
        "0REDUCE1": (10.0, 10.0),  # data parallelism of 1: nothing to reduce
        "0UPDATE1v1": (10.0, 10.0),  # unit costs: updates take no time
    }
    assert timeline(result, 1) == {
        "1RECV_F0": (0.0, 0.0),
        "1F0": (1.5, 2.5),
        "1RECV_F1": (2.5, 2.5),
        "1B0": (2.5, 4.5),
        "1SEND_B0": (4.5, 5.0),
        "1F1": (4.5, 5.5),
        "1B1": (5.5, 7.5),
        "1SEND_B1": (7.5, 8.0),
        "1REDUCE1": (7.5, 7.5),
        "1UPDATE1v1": (7.5, 7.5),
    }
    assert result.makespan == 10.0
    assert result.busy(0) == result.busy(1) == 6.0


def test_messages_on_one_channel_travel_one_after_another() -> None:
    def slow(rank: int, action: Action) -> float:
        del rank, action
        return 2.0

    result = replay(build("1f1b", 2, 2), transfer=slow)
    sends = timeline(result, 0)
    assert sends["0SEND_F0"] == (1.0, 3.0)
    assert sends["0SEND_F1"] == (3.0, 5.0)  # ready at 2, the channel is busy until 3
    assert timeline(result, 1)["1F1"] == (6.0, 7.0)  # arrived at 5, after 1B0 (4..6)


def _without_receives(result: Replay, rank: int) -> list[tuple[str, float, float]]:
    recv = (Op.RECV_F, Op.RECV_B)
    return [(str(e.action), e.start, e.end) for e in result.events[rank] if e.action.op not in recv]


def test_compute_only_schedules_send_where_lowering_places_sends() -> None:
    lowered = build("1f1b", 3, 4)
    bare = add_reductions(compute_only(lowered))

    def slow(rank: int, action: Action) -> float:  # the channel is busy: messages queue
        del rank, action
        return 2.0

    for transfer in (None, half, slow):
        kwargs = {} if transfer is None else {"transfer": transfer}
        a, b = replay(lowered, **kwargs), replay(bare, **kwargs)
        assert a.makespan == b.makespan
        for rank in range(3):
            assert _without_receives(a, rank) == _without_receives(b, rank)
    # one micro-batch: 3 forwards, 3 backwards and 4 hops on the critical path
    assert replay(one_f_one_b(3, 1), transfer=half).makespan == 3 * 1.0 + 3 * 2.0 + 4 * 0.5
    # `test_messages_on_one_channel_travel_one_after_another`, without the lowering
    sends = timeline(replay(compute_only(build("1f1b", 2, 2)), transfer=slow), 0)
    assert sends["0SEND_F0"] == (1.0, 3.0) and sends["0SEND_F1"] == (3.0, 5.0)


def test_durations_come_from_the_callable() -> None:
    def by_rank(rank: int, action: Action) -> float:
        return (2.0 if rank == 1 else 1.0) * unit_duration(rank, action)

    result = replay(one_f_one_b(2, 1), duration=by_rank)  # compute-only: sends take no time
    assert timeline(result, 0) == {
        **{"0F0": (0.0, 1.0), "0SEND_F0": (1.0, 1.0)},
        **{"0B0": (7.0, 9.0), "0UPDATE0v1": (9.0, 9.0)},
    }
    assert timeline(result, 1) == {
        **{"1F0": (1.0, 3.0), "1B0": (3.0, 7.0)},
        **{"1SEND_B0": (7.0, 7.0), "1UPDATE0v1": (7.0, 7.0)},
    }


def test_peak_inflight_counts_until_the_weight_gradients() -> None:
    schedule = zero_bubble_h1(2, 2)
    assert [str(a) for a in schedule.ranks[1]] == [
        *("1F0", "1BI0", "1F1", "1BI1", "1BW0", "1BW1", "1UPDATE1v1")
    ]
    assert replay(schedule).peak_inflight == (2, 2)


def test_a_blocked_rank_reports_what_it_waits_for() -> None:
    schedule = one_f_one_b(2, 2).with_programs(
        [
            [Action(Op.F, 0, 0), Action(Op.B, 0, 0)],
            [Action(Op.F, 1, 1), Action(Op.F, 1, 0), Action(Op.B, 1, 0)],
        ]
    )
    result = replay(schedule)
    assert not result.completed
    assert [(b.rank, b.index, str(b.action), b.waiting_for) for b in result.blocked] == [
        (0, 1, "0B0", "input gradients of 1B0"),
        (1, 0, "1F1", "forward 0F1"),
    ]
    assert [str(e.action) for e in result.events[0]] == ["0F0", "0SEND_F0"]  # sent, unread
    assert result.events[1] == ()


def test_out_of_range_actions_are_rejected_before_running() -> None:
    schedule = one_f_one_b(2, 2)
    bad = schedule.with_programs([[*schedule.ranks[0], Action(Op.F, 0, 5)], schedule.ranks[1]])
    with pytest.raises(ValueError, match=r"outside stages 0\.\.1 or micro-batches 0\.\.1"):
        replay(bad)
    past_the_end = schedule.with_programs([[Action(Op.SEND_B, 0, 0)], []])
    with pytest.raises(ValueError, match="sends past the end of its pipeline"):
        replay(past_the_end)


@pytest.mark.parametrize(("kind", "chunks"), [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_unit_summary_matches_the_full_replay(kind: str, chunks: int) -> None:
    schedule = build(kind, 4, 6, chunks)
    full, summary = replay(schedule), unit_summary(schedule)
    assert summary.completed and summary.makespan == full.makespan
    assert summary.peak_inflight == full.peak_inflight
    assert summary.busy == tuple(full.busy(r) for r in range(4))
