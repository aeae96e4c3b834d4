"""The validator rejects broken schedules with the grid and the culprit in brackets."""

from __future__ import annotations

import pytest

from plait.schedule import (
    Action,
    Schedule,
    ScheduleError,
    add_communication,
    build,
    one_f_one_b,
    validate,
)


def schedule_of(*programs: str, base: Schedule | None = None) -> Schedule:
    """Programs as space-separated actions, on the placement of `base` (2-rank 1F1B)."""
    base = base or one_f_one_b(2, 2)
    return base.with_programs([[Action.parse(a) for a in p.split()] for p in programs])


def rejects(schedule: Schedule, *fragments: str) -> str:
    with pytest.raises(ScheduleError) as caught:
        validate(schedule)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    # the whole grid: one row per rank
    assert all(f"rank {r:<2}" in message for r in range(schedule.num_ranks)), message
    return message


def test_the_base_schedules_are_valid() -> None:
    validate(schedule_of("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"))
    validate(add_communication(one_f_one_b(2, 2)))


def test_missing_backward() -> None:
    rejects(
        schedule_of("0F0 0F1 0B0 0B1", "1F0 1B0 1F1"),
        "backward of stage 1 micro-batch 1 is missing",
        "[1F1]",
    )


def test_missing_forward_marks_its_backward() -> None:
    rejects(schedule_of("0F0 0B0 0B1", "1F0 1B0 1F1 1B1"), "forward 0F1 is missing", "[0B1]")


def test_duplicate_forward() -> None:
    rejects(
        schedule_of("0F0 0F1 0F0 0B0 0B1", "1F0 1B0 1F1 1B1"),
        "rank 0 action 2 (0F0): F repeated",
        "[0F0]",
    )


def test_backward_before_forward_on_a_rank() -> None:
    rejects(
        schedule_of("0F0 0B1 0F1 0B0", "1F0 1B0 1F1 1B1"),
        "rank 0 action 1 (0B1): comes before 0F1 on this rank",
        "[0B1]",
    )


def test_weight_gradients_before_input_gradients() -> None:
    rejects(
        schedule_of("0F0 0F1 0B0 0B1", "1F0 1BW0 1BI0 1F1 1B1"),
        "(1BW0): comes before 1BI0",
        "[1BW0]",
    )


def test_full_and_split_backward_together() -> None:
    rejects(
        schedule_of("0F0 0F1 0B0 0B1", "1F0 1B0 1BI0 1BW0 1F1 1B1"),
        "both full and split backward",
        "[1B0]",
    )


def test_action_on_the_wrong_rank() -> None:
    rejects(
        schedule_of("0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"),
        "rank 0 action 4 (1F0): stage 1 is placed on rank 1",
        "[1F0]",
    )


def test_indices_out_of_range() -> None:
    rejects(schedule_of("0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1"), "micro-batch 2", "[0F2]")
    rejects(schedule_of("0F0 0F1 0B0 0B1 2F0", "1F0 1B0 1F1 1B1"), "stage 2 >= 2", "[2F0]")


LOWERED = [
    "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1 0UPDATE1v1",
    "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1UPDATE1v1",
]


def test_lowered_base_is_valid() -> None:
    assert schedule_of(*LOWERED) == add_communication(one_f_one_b(2, 2))
    validate(schedule_of(*LOWERED))


def test_missing_send() -> None:
    rank0 = LOWERED[0].replace(" 0SEND_F1", "")
    rejects(schedule_of(rank0, LOWERED[1]), "0SEND_F1 is missing", "[0F1]")


def test_missing_receive() -> None:
    rank1 = LOWERED[1].replace(" 1RECV_F1", "")
    rejects(schedule_of(LOWERED[0], rank1), "1RECV_F1 is missing", "[1F1]")


def test_repeated_send_and_send_inside_a_rank() -> None:
    rank0 = LOWERED[0].replace("0SEND_F1", "0SEND_F1 0SEND_F1")
    rejects(schedule_of(rank0, LOWERED[1]), "(0SEND_F1): is repeated", "[0SEND_F1]")
    lone = schedule_of("0F0 0F1 0SEND_F1 0B0 0B1", base=one_f_one_b(1, 2))
    rejects(lone, "crosses no rank boundary", "[0SEND_F1]")


def test_send_before_its_data() -> None:
    rank0 = LOWERED[0].replace("0F0 0SEND_F0", "0SEND_F0 0F0")
    rejects(schedule_of(rank0, LOWERED[1]), "(0SEND_F0): comes before 0F0", "[0SEND_F0]")


def test_receive_posted_after_its_consumer() -> None:
    rank1 = LOWERED[1].replace("1RECV_F0 1F0", "1F0 1RECV_F0")
    rejects(schedule_of(LOWERED[0], rank1), "is posted after the action that uses it", "[1RECV_F0]")


def test_receives_out_of_the_channels_send_order() -> None:
    """Rank 0 sends micro-batch 0 first; rank 1 posts micro-batch 1's receive first."""
    rank1 = LOWERED[1].replace("1RECV_F0 1F0 1RECV_F1", "1RECV_F1 1RECV_F0 1F0")
    rejects(
        schedule_of(LOWERED[0], rank1),
        "rank 0 sends the activations for stage 1 micro-batch 0 first on this channel",
        "[1RECV_F1]",
    )


def test_deadlock_of_two_ranks_waiting_for_each_other() -> None:
    """Rank 0 runs 0B0 before 0F1, and waits for 1B0; rank 1 runs 1F1 before 1B0, and
    waits for 0F1: a cycle. Each program is locally legal."""
    cycle = schedule_of("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1")
    message = rejects(cycle, "deadlock", "[0B0]", "[1F1]")
    assert "rank 0 at 0B0 waits for input gradients of 1B0" in message
    assert "rank 1 at 1F1 waits for forward 0F1" in message
    lowered = rejects(add_communication(cycle), "deadlock", "[0B0]", "[1F1]")
    assert "the gradients sent to stage 0 for micro-batch 0" in lowered


def test_validation_report_of_a_valid_schedule() -> None:
    report = validate(build("1f1b", 2, 2))
    assert report.makespan == 9.0 and report.peak_inflight == (2, 1)
    assert report.bubble_fraction == pytest.approx(1 - 12 / 18)
