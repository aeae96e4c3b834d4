"""Schedules written out literally, and reviewed text grids kept in tests/golden."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plait.schedule import (
    Action,
    Op,
    Schedule,
    build,
    compute_only,
    format_grid,
    format_program,
    gpipe,
    one_f_one_b,
    pipedream,
    replay,
    zero_bubble_h1,
)

GOLDEN = Path(__file__).parent.parent / "golden"


def programs(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in program] for program in schedule.ranks]


def words(text: str) -> list[str]:
    return text.split()


def test_1f1b_two_ranks_three_microbatches() -> None:
    assert programs(one_f_one_b(2, 3)) == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2", "0UPDATE2v1"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1UPDATE2v1"],
    ]


def test_gpipe_two_ranks_two_microbatches() -> None:
    assert programs(gpipe(2, 2)) == [
        ["0F0", "0F1", "0B0", "0B1", "0UPDATE1v1"],
        ["1F0", "1F1", "1B0", "1B1", "1UPDATE1v1"],
    ]


def test_1f1b_lowered_posts_receives_one_compute_ahead_and_sends_at_once() -> None:
    """...and reduces each stage's gradients right after its last backward."""
    assert programs(build("1f1b", 2, 3)) == [
        words(
            "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0F2 0SEND_F2 0RECV_B2 0B1 0B2 "
            "0REDUCE2 0UPDATE2v1"
        ),
        words(
            "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1RECV_F2 1B1 1SEND_B1 1F2 1B2 1SEND_B2 "
            "1REDUCE2 1UPDATE2v1"
        ),
    ]


def test_pipedream_window_runs_backwards_of_the_previous_window() -> None:
    """Stage 0 of two holds one micro-batch more: its window backs micro-batch -1 (the last
    of the previous window) after forwarding 0; versions are those of window 0."""
    assert programs(pipedream(2, 2)) == [
        ["0F0v-1", "0B-1v-2", "0UPDATE-1v0", "0F1v0", "0B0v-1", "0UPDATE0v1"],
        ["1F0v0", "1B0v0", "1UPDATE0v1", "1F1v1", "1B1v1", "1UPDATE1v2"],
    ]


def test_zb_h1_three_ranks_three_microbatches() -> None:
    assert programs(zero_bubble_h1(3, 3)) == [
        ["0F0", "0F1", "0F2", "0BI0", "0BW0", "0BI1", "0BW1", "0BI2", "0BW2", "0UPDATE2v1"],
        ["1F0", "1F1", "1BI0", "1F2", "1BI1", "1BW0", "1BI2", "1BW1", "1BW2", "1UPDATE2v1"],
        ["2F0", "2BI0", "2F1", "2BI1", "2F2", "2BI2", "2BW0", "2BW1", "2BW2", "2UPDATE2v1"],
    ]


def test_gpipe_grid_under_unit_costs() -> None:
    assert format_grid(build("gpipe", 2, 2)).splitlines() == [
        "time     0   1   2   3   4   5   6   7   8",
        "rank 0 0F0 0F1   .   .   . 0B0   ~ 0B1   ~",
        "rank 1   . 1F0 1F1 1B0   ~ 1B1   ~   .   .",
    ]


def test_program_grid_marks_an_action() -> None:
    text = format_program(gpipe(2, 2), mark=frozenset({(1, 2)}))
    assert text.splitlines()[1].split() == ["rank", "1", "1F0", "1F1", "[1B0]", "1B1", "1UPDATE1v1"]


def test_action_text() -> None:
    assert str(Action(Op.SEND_B, 3, 7)) == "3SEND_B7"
    assert str(Action(Op.F, 0, 2, version=1)) == "0F2v1"


@pytest.mark.parametrize(
    ("kind", "stages", "microbatches", "chunks"),
    [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 3, 5, 1)],
)
def test_golden_grid(kind: str, stages: int, microbatches: int, chunks: int) -> None:
    """Set PLAIT_UPDATE_GOLDEN=1 to rewrite a grid; then review the diff by eye."""
    schedule = build(kind, stages, microbatches, chunks)
    grid = format_grid(schedule) + "\n"
    path = GOLDEN / f"{kind}_p{stages}_m{microbatches}_v{chunks}.txt"
    if os.environ.get("PLAIT_UPDATE_GOLDEN") == "1":
        path.write_text(grid)
    assert grid == path.read_text(), f"{path.name} differs; see the module docstring"
    # the grid is a picture of the unit-cost replay, messages and all
    assert format_grid(compute_only(schedule)) + "\n" == grid
    assert replay(schedule).completed
