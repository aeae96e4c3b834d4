"""The IR's stream of windows: text form, concrete windows, weight versions and their
policies, cross-window validation, lowering, and the closed forms of weight copies."""

from __future__ import annotations

import pytest
from tests.unit.test_schedule_validate import rejects

from plait.schedule import (
    KINDS,
    Action,
    Op,
    RankStream,
    Schedule,
    WeightPlanner,
    add_communication,
    build,
    kind_names,
    one_f_one_b,
    pipedream,
    unroll,
    validate,
)
from plait.schedule.stream import concrete_window

ASYNC = kind_names(synchronous=False)


def words(actions: tuple[Action, ...] | list[Action]) -> list[str]:
    return [str(a) for a in actions]


def window(*programs: str, policy: str, m: int, base: Schedule | None = None) -> Schedule:
    """A window from space-separated actions, on the placement of `base` (2 ranks)."""
    base = base or one_f_one_b(2, m)
    rows = [[Action.parse(a) for a in p.split()] for p in programs]
    return Schedule(
        kind="custom",
        num_ranks=base.num_ranks,
        num_microbatches=m,
        stage_to_rank=base.stage_to_rank,
        ranks=tuple(tuple(r) for r in rows),
        policy=policy,
    )


# ------------------------------------------------------------------- text
@pytest.mark.parametrize(
    "text", ["2F0", "1RECV_B3", "0BI4", "0BW4", "0B-1v-2", "3UPDATE7v2", "0REDUCE-1", "1FREE3v0"]
)
def test_action_text_round_trips(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_every_op_parses_back() -> None:
    for op in Op:
        action = Action(op, 2, -3, 5)
        assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["F0", "0X1", "0F", "0F1v", "-1F0"])
def test_bad_action_text(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not an action|is not one of"):
        Action.parse(text)


# --------------------------------------------------------------- the stream
def test_windows_shift_ids_and_versions_and_drop_the_past() -> None:
    """Window i runs window 0's program with ids + i·m and versions + i·u; micro-batches
    below 0 are not run and versions below 0 are the initial weights."""
    s = pipedream(2, 2)  # m = 2 micro-batches and u = 2 updates per window
    assert words(s.ranks[0]) == [
        *("0F0v-1", "0B-1v-2", "0UPDATE-1v0", "0F1v0", "0B0v-1", "0UPDATE0v1"),
    ]
    assert words(concrete_window(s, 0, 0)) == ["0F0v0", "0F1v0", "0B0v0", "0UPDATE0v1"]
    assert words(concrete_window(s, 0, 1)) == [
        *("0F2v1", "0B1v0", "0UPDATE1v2", "0F3v2", "0B2v1", "0UPDATE2v3"),
    ]
    assert words(concrete_window(s, 0, 2, end=4)) == ["0B3v2", "0UPDATE3v4"]  # the drain


def test_a_run_of_pipedream_with_its_weight_copies() -> None:
    """Two stages, two micro-batches a window, two windows: stage 0 computes micro-batch
    x on version x - 1 and keeps it until its backward, after the next update."""
    run = unroll(pipedream(2, 2), 2).schedule
    compute = [a for a in run.ranks[0] if a.op not in (Op.SEND_F, Op.RECV_B, Op.REDUCE)]
    assert words(compute) == [
        *("0F0v0", "0STASH1v0", "0F1v0", "0B0v0", "0UPDATE0v1"),  # window 0
        *("0STASH2v1", "0F2v1", "0B1v0", "0FREE1v0", "0UPDATE1v2"),  # window 1
        *("0STASH3v2", "0F3v2", "0B2v1", "0FREE2v1", "0UPDATE2v3"),
        *("0B3v2", "0FREE3v2", "0UPDATE3v4"),  # the drain
    ]
    assert run.num_microbatches == 4 and run.reach == 0


@pytest.mark.parametrize("kind", ASYNC)
@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 1), (2, 3), (3, 2), (4, 1), (4, 5)])
def test_window_by_window_copies_equal_those_of_the_whole_run(kind: str, p: int, m: int) -> None:
    """The runtime plans weight copies a window at a time with a bounded look-ahead; each
    window comes out as when the whole run (as far as it goes) is known."""
    schedule = build(kind, p, m)
    windows = 5
    longer = unroll(schedule, windows + schedule.reach + 3, plan=False)
    for rank in range(p):
        stream = RankStream(schedule, rank)
        whole = WeightPlanner(schedule.policy)
        program, starts = longer.schedule.ranks[rank], longer.starts[rank]
        for w in range(windows):
            expected = whole.plan(program[starts[w] : starts[w + 1]], program[starts[w + 1] :])
            assert list(stream.window()) == expected, (kind, p, m, w, rank)
        stream.drain()
        assert not stream.planner or not stream.planner.slots  # every copy freed


def test_a_drained_stream_ends() -> None:
    stream = RankStream(pipedream(2, 2), 0)
    stream.window()
    stream.drain()
    assert stream.drain() == ()
    with pytest.raises(RuntimeError, match="drained"):
        stream.window()


# ---------------------------------------------------------- version policies
@pytest.mark.parametrize("kind", ASYNC)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6])
def test_weight_copies_match_the_closed_forms(kind: str, p: int, m: int) -> None:
    report = validate(build(kind, p, m))
    entry = KINDS[kind]
    assert report.peak_weight_versions == tuple(entry.versions(p, m, s) for s in range(p))
    assert report.peak_weight_copies == tuple(entry.copies(p, m, s) for s in range(p))


def test_pipedream_versions_follow_the_paper() -> None:
    """Stage s computes micro-batch x on the weights with the updates of micro-batches up
    to x - (p - s), as its forward found them, and its backward on the same."""
    p = 3
    run = unroll(pipedream(p, 4), 3).schedule
    for rank, program in enumerate(run.ranks):
        for a in program:
            if a.op in (Op.F, Op.B):
                assert a.version == max(0, a.microbatch - (p - 1 - rank)), a


def test_2bw_versions_are_one_behind_on_every_stage() -> None:
    m = 3
    run = unroll(build("2bw", 3, m), 4).schedule
    for program in run.ranks:
        for a in program:
            if a.op in (Op.F, Op.B):
                assert a.version == max(0, a.microbatch // m - 1), a


@pytest.mark.parametrize("kind", ["pipedream", "2bw", "spectrain"])
def test_the_steady_window_has_no_bubble(kind: str) -> None:
    """Under unit costs every rank computes all the time between warm-up and drain: a
    window takes m × (forward 1 + backward 2)."""
    for p in (2, 3, 4):
        for m in (p, p + 2):
            assert validate(build(kind, p, m)).window_time == pytest.approx(3 * m), (p, m)


def test_a_backward_on_another_version_than_its_forward() -> None:
    message = rejects(
        window("0F0v0 0B0v1 0UPDATE0v1", "1F0v0 1B0v0 1UPDATE0v1", policy="stash", m=1),
        "its forward 0F0 used version 0: a backward must use the weights of its forward",
    )
    assert "[0B0v1]" in message


def test_stashing_forwards_on_an_old_version() -> None:
    rejects(
        window(
            "0F0v-1 0B0v-1 0UPDATE0v1",
            "1F0v0 1B0v0 1UPDATE0v1",
            policy="stash",
            m=1,
        ),
        "a 'stash' schedule uses the current weights: stage 0 is at version 1",
        "[0F1v0]",
    )


def test_three_versions_alive_under_2bw() -> None:
    """One stage computing micro-batch x on version x - 2 keeps three versions."""
    single = one_f_one_b(1, 3)
    message = rejects(
        window(
            "0F0v-2 0B0v-2 0UPDATE0v1 0F1v-1 0B1v-1 0UPDATE1v2 0F2v0 0B2v0 0UPDATE2v3",
            policy="2bw",
            m=3,
            base=single,
        ),
        "versions of stage 0 alive at once",
        "2BW keeps at most 2 versions",
    )
    assert "[0" in message


def test_vertical_sync_needs_one_version_per_microbatch() -> None:
    rejects(
        window("0F0v0 0B0v0 0UPDATE0v1", "1F0v1 1B0v1 1UPDATE0v1", policy="vertical", m=1),
        "micro-batch 0 ran its first stage on version 0",
        "[1F0v1]",
    )


def test_prediction_targets_the_version_its_gradient_meets() -> None:
    rejects(
        window(
            "0F0v0 0B-1v-1 0UPDATE-1v0",
            "1F0v1 1B0v1 1UPDATE0v1",
            policy="predict",
            m=1,
        ),
        "the gradient of micro-batch 0 is applied to version 0 of stage 1",
        "[1F0v1]",
    )


def test_a_synchronous_window_updates_after_its_backwards() -> None:
    rejects(
        window("0F0 0UPDATE0v1 0B0", "1F0 1B0 1UPDATE0v1", policy="sync", m=1),
        "updates stage 0 while 1 of its micro-batches are in flight",
        "[0UPDATE0v1]",
    )


def test_an_update_producing_the_wrong_version() -> None:
    rejects(
        window("0F0v0 0B0v0 0UPDATE0v2", "1F0v0 1B0v0 1UPDATE0v1", policy="stash", m=1),
        "stage 0 has made 0 updates, so this one produces version 1",
    )


# -------------------------------------------------------- the window itself
def test_a_window_runs_no_later_microbatch() -> None:
    rejects(
        window("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1", policy="sync", m=1),
        "micro-batch 1 is not in this window (0..0) nor an earlier one",
    )


def test_data_from_a_later_window() -> None:
    """Stage 1 would forward micro-batch 0 one window before stage 0 does."""
    rejects(
        window("0F-1 0B-1", "1F0 1B0", policy="sync", m=1),
        "runs 1 window(s) before the 0F it needs",
    )


def test_a_deadlock_only_the_second_window_shows() -> None:
    """Window 0 has no micro-batch -1, so it runs; from window 1 on, rank 0 waits in
    0B-1 for 1B-1, which rank 1 runs after 1F0, which waits for 0F0 after 0B-1."""
    schedule = window(
        "0B-1v-1 0UPDATE-1v0 0F0v0", "1F0v-1 1B-1v-2 1UPDATE-1v0", policy="stash", m=1
    )
    assert validate(unroll(schedule, 1).schedule)  # one window alone is fine
    message = rejects(schedule, "deadlock", "rank 0 at 0B0")
    assert "waits for input gradients of 1B0" in message


def test_copy_actions_are_not_written_by_hand() -> None:
    rejects(
        window(
            "0STASH0v0 0F0v0 0B-1v-1 0UPDATE-1v0", "1F0v0 1B0v0 1UPDATE0v1", policy="stash", m=1
        ),
        "weight copies are derived",
    )


# ---------------------------------------------------------------- lowering
def test_lowered_pipedream_window() -> None:
    """Receives for backwards of the previous window's micro-batch are posted in the
    order the peer sends, one compute action ahead, never across the window's start."""
    lowered = build("pipedream", 2, 2)
    assert words(lowered.ranks[0]) == [
        "0RECV_B-1",
        "0F0v-1",
        "0SEND_F0",
        "0B-1v-2",
        "0REDUCE-1",
        "0UPDATE-1v0",
        "0RECV_B0",
        "0F1v0",
        "0SEND_F1",
        "0B0v-1",
        "0REDUCE0",
        "0UPDATE0v1",
    ]
    assert words(lowered.ranks[1]) == [
        "1RECV_F0",
        "1F0v0",
        "1RECV_F1",
        "1B0v0",
        "1SEND_B0",
        "1REDUCE0",
        "1UPDATE0v1",
        "1F1v1",
        "1B1v1",
        "1SEND_B1",
        "1REDUCE1",
        "1UPDATE1v2",
    ]


def test_pipelines_are_data() -> None:
    """A stage graph that skips stage 1 entirely: micro-batches go 0 -> 2."""
    base = Schedule(
        kind="skip",
        num_ranks=3,
        num_microbatches=1,
        stage_to_rank=(0, 1, 2),
        ranks=(
            (Action.parse("0F0"), Action.parse("0B0")),
            (),
            (Action.parse("2F0"), Action.parse("2B0")),
        ),
        pipelines=((0, 2),),
    )
    assert base.next_stage(0) == 2 and base.prev_stage(2) == 0 and base.is_last(2)
    assert base.path(0) == (0, 2)
    validate(base)
    lowered = add_communication(base)
    assert words(lowered.ranks[0]) == ["0RECV_B0", "0F0", "0SEND_F0", "0B0"]
    assert words(lowered.ranks[2]) == ["2RECV_F0", "2F0", "2B0", "2SEND_B0"]
    validate(lowered)
    assert Schedule.from_json(lowered.to_json()) == lowered


def test_a_stage_in_two_pipelines_is_refused() -> None:
    with pytest.raises(ValueError, match="at most one pipeline"):
        Schedule(
            kind="x",
            num_ranks=1,
            num_microbatches=1,
            stage_to_rank=(0, 0),
            ranks=((),),
            num_chunks=2,
            pipelines=((0, 1), (1,)),
        )
