"""Lowering a rank's actions, and its programs under NCCL's stream rule."""

from __future__ import annotations

import pytest

from plait.schedule import KINDS, Action, Op, Schedule, build
from plait.schedule.lower import (
    DATA,
    LOCAL,
    LOSS,
    NONE,
    REMOTE,
    channel,
    lower,
    stream_deadlock,
)
from plait.schedule.passes import forward_only
from plait.schedule.stream import unroll


def _acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(t) for t in text.split())


def test_a_1f1b_rank_resolves_its_peers_and_hand_offs() -> None:
    schedule = build("1f1b", 2, 2)
    last = lower(schedule, 1, schedule.ranks[1])
    assert [str(s.action) for s in last.steps] == [str(a) for a in schedule.ranks[1]]
    by_label = {str(s.action): s for s in last.steps}
    assert (by_label["1F0"].source, by_label["1F0"].target) == (REMOTE, LOSS)
    assert (by_label["1B0"].source, by_label["1B0"].target) == (LOSS, REMOTE)
    receive = by_label["1RECV_F0"].batch
    assert receive is not None and len(receive.messages) == 1
    (m,) = receive.messages
    assert (m.peer, m.peer_stage, m.channel, m.is_send) == (0, 0, (0, 1), False)
    send = by_label["1SEND_B0"].batch
    assert send is not None and send.channel == channel(1, 0) == (1, 0)
    assert by_label["1B1"].completes and not by_label["1B0"].completes
    first = {str(s.action): s for s in lower(schedule, 0, schedule.ranks[0]).steps}
    assert (first["0F0"].source, first["0F0"].target) == (DATA, REMOTE)
    assert (first["0B0"].source, first["0B0"].target) == (REMOTE, NONE)


def test_stages_on_one_rank_hand_on_locally() -> None:
    schedule = build("interleaved", 1, 2, 2)  # stages 0 and 1 on rank 0
    steps = {str(s.action): s for s in lower(schedule, 0, schedule.ranks[0]).steps}
    assert (steps["0F0"].source, steps["0F0"].target) == (DATA, LOCAL)
    assert (steps["1F0"].source, steps["1F0"].target) == (LOCAL, LOSS)
    assert (steps["1B0"].source, steps["1B0"].target) == (LOSS, LOCAL)
    assert all(s.batch is None for s in steps.values())


def test_consecutive_sends_on_a_channel_are_one_batch_and_receives_are_alone() -> None:
    """A GPipe whose sends wait for the whole forward phase: rank 0 sends both micro-
    batches at once, rank 1 both gradients; each receive stays its own batch."""
    schedule = Schedule(
        kind="test", num_ranks=2, num_microbatches=2, stage_to_rank=(0, 1),
        ranks=(
            _acts("0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1"),
            _acts("1RECV_F0 1RECV_F1 1F0 1F1 1B0 1B1 1SEND_B0 1SEND_B1"),
        ),
    )  # fmt: skip
    first, second = (lower(schedule, r, schedule.ranks[r]) for r in (0, 1))
    assert [[str(m.action) for m in b.messages] for b in first.batches] == [
        ["0SEND_F0", "0SEND_F1"], ["0RECV_B0"], ["0RECV_B1"]
    ]  # fmt: skip
    assert [[str(m.action) for m in b.messages] for b in second.batches] == [
        ["1RECV_F0"], ["1RECV_F1"], ["1SEND_B0", "1SEND_B1"]
    ]  # fmt: skip
    assert stream_deadlock(schedule) is None


def test_one_process_group_for_the_pipeline_deadlocks_1f1b_on_nccl_streams() -> None:
    """Rank 0 posts 0B0's receive before sending 0F1, rank 1 posts 1F1's receive before
    sending 1B0: on one stream each, the receives block the sends behind them."""
    schedule = build("1f1b", 2, 4)
    assert stream_deadlock(schedule) is None
    stuck = stream_deadlock(schedule, shared_channel=True)
    assert stuck is not None
    assert "rank 0 batch 0RECV_B0" in stuck and "rank 1 batch 1RECV_F1" in stuck


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_is_deadlock_free_on_its_channels(kind: str) -> None:
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 5, 8):
            for chunks in {KINDS[kind].default_chunks, 1, 2}:
                try:
                    schedule = build(kind, p, m, chunks)
                except ValueError:  # a size the kind does not take
                    continue
                run = unroll(schedule, 3, plan=False).schedule
                assert stream_deadlock(run) is None, (kind, p, m, chunks)


def test_the_forward_only_program_follows_each_micro_batch_along_its_path() -> None:
    schedule = build("1f1b", 2, 4)
    program = forward_only(schedule, 3)
    assert [" ".join(map(str, p)) for p in program.ranks] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2",
        "1RECV_F0 1F0 1RECV_F1 1F1 1RECV_F2 1F2",
    ]
    assert program.num_microbatches == 3 and program.stage_to_rank == schedule.stage_to_rank
    assert stream_deadlock(program) is None
    assert all(a.op in (Op.F, Op.SEND_F, Op.RECV_F) for p in program.ranks for a in p)
