"""Every generator over small grids: builds, validates, round-trips through JSON, replays."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.schedule import (
    KINDS,
    Op,
    Schedule,
    ScheduleError,
    add_communication,
    build,
    compute_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    replay,
    unroll,
    validate,
    zero_bubble_h1,
)

# (kind, chunks): every registered kind, interleaving with 2 and with 3 virtual stages
CASES = [(k, KINDS[k].default_chunks) for k in KINDS if k != "interleaved"] + [
    ("interleaved", 2),
    ("interleaved", 3),
]
SCHEDULE_KEYS = {
    "kind",
    "policy",
    "stages",
    "microbatches",
    "chunks",
    "num_stages",
    "stage_to_rank",
    "ranks",
}


def check_round_trip(schedule: Schedule) -> None:
    text = schedule.to_json()
    data = json.loads(text)
    assert set(data) == SCHEDULE_KEYS | ({"pipelines"} if schedule.pipelines else set())
    for program in data["ranks"]:
        for a in program:
            # versions only where the schedule has them: updates, and asynchronous computes
            has_version = a["op"] == "UPDATE" or (schedule.policy != "sync" and a["op"] in "FB")
            assert set(a) == {"op", "stage", "mb"} | ({"version"} if has_version else set()), a
    assert Schedule.from_json(text) == schedule
    assert Schedule.from_dict(schedule.to_dict()) == schedule


@pytest.mark.parametrize(("kind", "chunks"), CASES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_every_generator_builds_validates_round_trips_and_replays(
    kind: str, chunks: int, stages: int
) -> None:
    for microbatches in range(1, 10):
        schedule = build(kind, stages, microbatches, chunks)
        assert schedule.num_ranks == stages and schedule.num_parts == stages * chunks
        report = validate(schedule)
        check_round_trip(schedule)
        result = replay(schedule)
        assert result.completed
        assert result.makespan == report.makespan
        # each rank ran its whole run of one window, in program order
        run = unroll(schedule).schedule
        for rank, events in enumerate(result.events):
            assert [e.action for e in events] == list(run.ranks[rank])
            assert [e.index for e in events] == list(range(len(events)))


@pytest.mark.parametrize(("kind", "chunks"), CASES)
def test_lowering_keeps_the_compute_order(kind: str, chunks: int) -> None:
    """build() = generator + reductions + communication: stripping the messages and the
    reductions gives the generator's programs back, and the unit-cost timeline is the same
    with and without messages."""
    generate = KINDS[kind].generate
    for stages, microbatches in [(2, 3), (3, 5), (4, 8)]:
        bare = generate(stages, microbatches, chunks)
        lowered = build(kind, stages, microbatches, chunks)
        assert compute_only(lowered) == bare
        assert validate(bare).makespan == validate(lowered).makespan
        ops = {a.op for program in lowered.ranks for a in program}
        assert {Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B} <= ops  # every size here has p > 1


def test_generators_are_pure_functions_of_integers() -> None:
    assert one_f_one_b(3, 5) == one_f_one_b(3, 5)
    assert gpipe(2, 4) != one_f_one_b(2, 4)
    assert interleaved_1f1b(2, 4, 2).stage_to_rank == (0, 1, 0, 1)
    assert zero_bubble_h1(3, 3).kind == "zb-h1"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpipe(0, 4), "num_stages=0"),
        (lambda: one_f_one_b(2, 0), "num_microbatches=0"),
        (lambda: interleaved_1f1b(2, 4, 1), "num_chunks=1"),
        (lambda: zero_bubble_h1(-1, 4), "num_stages=-1"),
        (lambda: build("chimera-x", 2, 4), "'chimera-x' is unknown"),
        (lambda: build("1f1b", 2, 4, 2), r"chunks=2 applies only to \['interleaved', 'zb-v'\]"),
        (lambda: build("zb-v", 2, 4, 3), "chunks=3: zb-v places exactly 2 stages on each rank"),
        (lambda: build("interleaved", 2, 4, 1), "chunks=1: interleaved needs >= 2"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_a_validation_failure_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


def test_lowering_an_already_lowered_schedule_is_idempotent() -> None:
    lowered = build("interleaved", 3, 6, 2)
    assert add_communication(lowered) == lowered


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    stages=st.integers(1, 6),
    microbatches=st.integers(1, 16),
    chunks=st.integers(2, 4),
)
def test_property_any_valid_size_builds_validates_and_round_trips(
    kind: str, stages: int, microbatches: int, chunks: int
) -> None:
    schedule = build(
        kind, stages, microbatches, chunks if kind == "interleaved" else KINDS[kind].default_chunks
    )
    report = validate(schedule)
    check_round_trip(schedule)
    assert len(report.peak_inflight) == stages
    assert 0.0 <= report.bubble_fraction < 1.0
    # one forward and one backward (whole, or both halves) per stage and micro-batch
    compute = [a for program in schedule.ranks for a in program if a.is_compute]
    forwards = [a for a in compute if a.op is Op.F]
    assert len(forwards) == schedule.num_parts * microbatches  # one path through the parts
    assert len(compute) == len(forwards) * (3 if KINDS[kind].split_backward else 2)
    # one window: every stage updates once per micro-batch, or once per window
    updates = [a for program in schedule.ranks for a in program if a.op is Op.UPDATE]
    per_stage = microbatches if kind in ("pipedream", "pipedream-vs", "spectrain") else 1
    assert len(updates) == schedule.num_stages * per_stage
