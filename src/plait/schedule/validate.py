"""The validator: proves a schedule correct before anything runs, or shows where it breaks.

Checks, in order: every action sits on the rank that owns its stage; every micro-batch has
exactly one forward and one backward (full, or split into BI then BW) on every stage; each
rank orders its own actions legally; in a lowered schedule every cross-rank boundary has
exactly one send and one receive, and the sends on each directed channel are posted in the
order the peer posts their receives (so that in-order transports such as NCCL match them);
finally abstract execution (`replay`) proves the programs cannot deadlock.

Each check first runs a fast test over integer action ids (a 64-rank, 512-micro-batch
schedule has 200 000 actions); only when that test fails does the plain, action-by-action
scan run, to name the first culprit in the error.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from operator import attrgetter

from plait.schedule.grid import format_grid, format_program
from plait.schedule.ir import COMM_OPS, Op, Schedule
from plait.schedule.replay import replay, unit_summary

__all__ = ["ScheduleError", "ValidationReport", "validate"]


class ScheduleError(ValueError):
    """A schedule that is not correct; the message ends with the grid, the culprit marked."""


@dataclass(frozen=True)
class ValidationReport:
    """What validation learned under unit costs."""

    peak_inflight: tuple[int, ...]  # per rank: most micro-batches whose activations it holds
    makespan: float  # unit costs: forward 1, backward 2
    bubble_fraction: float  # idle share of ranks × makespan


# Action ids: (code * num_stages + stage) * num_microbatches + microbatch, with these codes;
# compute ops come first, so that an id at or above 4 * stages * micro-batches is a message.
_CODE = {Op.F: 0, Op.B: 1, Op.BI: 2, Op.BW: 3, Op.SEND_F: 4, Op.RECV_F: 5, Op.SEND_B: 6}
_CODE[Op.RECV_B] = 7
_F, _B, _BI, _BW, _SEND_F, _RECV_F, _SEND_B, _RECV_B = range(8)
_stage_of = attrgetter("stage")
_microbatch_of = attrgetter("microbatch")


def _fail(schedule: Schedule, rank: int, index: int, why: str) -> ScheduleError:
    grid = format_program(schedule, mark=frozenset({(rank, index)}))
    action = schedule.ranks[rank][index]
    return ScheduleError(f"{schedule.kind}: rank {rank} action {index} ({action}): {why}\n{grid}")


def _missing(
    schedule: Schedule, rank: int, why: str, near: tuple[tuple[Op, ...], int, int] | None = None
) -> ScheduleError:
    """An error for an absent action; `near` = (ops, stage, micro-batch) of an action that
    is present and is marked instead (the forward whose backward is missing, say)."""
    mark: frozenset[tuple[int, int]] = frozenset()
    if near is not None:
        ops, stage, mb = near
        for index, a in enumerate(schedule.ranks[rank]):
            if a.op in ops and a.stage == stage and a.microbatch == mb:
                mark = frozenset({(rank, index)})
                why = f"{why} (see [{a}])"
                break
    return ScheduleError(
        f"{schedule.kind}: rank {rank}: {why}\n{format_program(schedule, mark=mark)}"
    )


def _ids(schedule: Schedule) -> list[list[int]]:
    """Per rank, the integer id of every action (valid once placement is checked)."""
    width, num_stages = schedule.num_microbatches, schedule.num_stages
    code = _CODE
    try:
        return [
            [(code[a.op] * num_stages + a.stage) * width + a.microbatch for a in program]
            for program in schedule.ranks
        ]
    except KeyError as err:  # an op added to the IR but not to the validator
        why = f"op {err.args[0]} is unknown to the validator: give it a code in _CODE"
        raise ScheduleError(why) from None


def _check_placement(schedule: Schedule) -> None:
    place = schedule.stage_to_rank
    for rank, program in enumerate(schedule.ranks):
        owned = {s for s, r in enumerate(place) if r == rank}
        if not program or (
            set(map(_stage_of, program)) <= owned
            and max(map(_microbatch_of, program)) < schedule.num_microbatches
        ):
            continue
        for index, a in enumerate(program):
            if a.stage >= schedule.num_stages:
                raise _fail(schedule, rank, index, f"stage {a.stage} >= {schedule.num_stages}")
            if a.microbatch >= schedule.num_microbatches:
                raise _fail(schedule, rank, index, f"micro-batch {a.microbatch} out of range")
            owner = place[a.stage]
            if owner != rank:
                raise _fail(schedule, rank, index, f"stage {a.stage} is placed on rank {owner}")


def _coverage_ok(schedule: Schedule, ids: list[list[int]]) -> bool:
    """No compute action repeated; every (stage, micro-batch) has F and B, or F, BI and BW."""
    size = schedule.num_stages * schedule.num_microbatches
    by_code: list[list[int]] = [[], [], [], []]  # F, B, BI, BW: stage * width + microbatch
    for program_ids in ids:
        for i in program_ids:
            code, rest = divmod(i, size)
            if code <= _BW:
                by_code[code].append(rest)
    f, b, bi, bw = (set(x) for x in by_code)
    if sum(map(len, by_code)) != len(f) + len(b) + len(bi) + len(bw):
        return False  # a repeat
    return len(f) == size and bi == bw and not (b & bi) and len(b) + len(bi) == size


def _check_coverage(schedule: Schedule, ids: list[list[int]]) -> None:
    if _coverage_ok(schedule, ids):
        return
    where: dict[tuple[Op, int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            if a.op not in COMM_OPS:
                where[(a.op, a.stage, a.microbatch)].append((rank, index))
    for key, places in where.items():
        if len(places) > 1:
            raise _fail(schedule, *places[1], f"{key[0].value} repeated for this micro-batch")
    backward = (Op.B, Op.BI, Op.BW)
    for s in range(schedule.num_stages):
        rank = schedule.stage_to_rank[s]
        for m in range(schedule.num_microbatches):
            has = {op for op in (Op.F, Op.B, Op.BI, Op.BW) if (op, s, m) in where}
            if Op.F not in has:
                raise _missing(schedule, rank, f"forward {s}F{m} is missing", (backward, s, m))
            if Op.B in has and has & {Op.BI, Op.BW}:
                raise _fail(schedule, *where[(Op.B, s, m)][0], "both full and split backward")
            if Op.B not in has and has & {Op.BI, Op.BW} != {Op.BI, Op.BW}:
                why = f"backward of stage {s} micro-batch {m} is missing"
                raise _missing(schedule, rank, why, ((Op.F, Op.BI, Op.BW), s, m))


_PREREQUISITE: dict[Op, tuple[Op, ...]] = {
    Op.B: (Op.F,),
    Op.BI: (Op.F,),
    Op.BW: (Op.BI,),
    Op.SEND_F: (Op.F,),
    Op.SEND_B: (Op.B, Op.BI),
}


def _local_order_ok(schedule: Schedule, ids: list[list[int]]) -> bool:
    """Each action after its prerequisite on its rank, each receive before its consumer."""
    size = schedule.num_stages * schedule.num_microbatches
    for program_ids in ids:
        done: list[set[int]] = [set() for _ in range(8)]  # per code: (stage, mb) ids seen
        f, b, bi = done[_F], done[_B], done[_BI]
        for i in program_ids:
            code, rest = divmod(i, size)
            if code in (_B, _BI, _SEND_F):
                if rest not in f:
                    return False
            elif code == _BW:
                if rest not in bi:
                    return False
            elif code == _SEND_B:
                if rest not in b and rest not in bi:
                    return False
            elif code == _RECV_F:
                if rest in f:
                    return False
            elif code == _RECV_B and (rest in b or rest in bi):
                return False
            done[code].add(rest)
    return True


def _check_local_order(schedule: Schedule, ids: list[list[int]]) -> None:
    if _local_order_ok(schedule, ids):
        return
    for rank, program in enumerate(schedule.ranks):
        seen: set[tuple[Op, int, int]] = set()
        for index, a in enumerate(program):
            needs = _PREREQUISITE.get(a.op, ())
            if needs and not any((op, a.stage, a.microbatch) in seen for op in needs):
                names = " or ".join(f"{a.stage}{op.value}{a.microbatch}" for op in needs)
                raise _fail(schedule, rank, index, f"comes before {names} on this rank")
            seen.add((a.op, a.stage, a.microbatch))
        position = {(a.op, a.stage, a.microbatch): i for i, a in enumerate(program)}
        for index, a in enumerate(program):
            if a.op in (Op.RECV_F, Op.RECV_B):
                consumer = (Op.F,) if a.op is Op.RECV_F else (Op.B, Op.BI)
                used = [
                    position[(op, a.stage, a.microbatch)]
                    for op in consumer
                    if (op, a.stage, a.microbatch) in position
                ]
                if any(u < index for u in used):
                    raise _fail(schedule, rank, index, "is posted after the action that uses it")


def _expected_messages(schedule: Schedule) -> Counter[tuple[Op, int, int]]:
    expected: Counter[tuple[Op, int, int]] = Counter()
    place = schedule.stage_to_rank
    for s in range(schedule.num_stages - 1):
        if place[s] != place[s + 1]:
            for m in range(schedule.num_microbatches):
                expected.update([(Op.SEND_F, s, m), (Op.RECV_F, s + 1, m)])
                expected.update([(Op.SEND_B, s + 1, m), (Op.RECV_B, s, m)])
    return expected


def _messages_ok(schedule: Schedule, messages: list[int]) -> bool:
    """Exactly one send and one receive per message across each rank boundary."""
    place, width = schedule.stage_to_rank, schedule.num_microbatches
    expected: set[int] = set()
    for s in range(schedule.num_stages - 1):
        if place[s] != place[s + 1]:
            for code, stage in ((_SEND_F, s), (_RECV_F, s + 1), (_SEND_B, s + 1), (_RECV_B, s)):
                first = (code * schedule.num_stages + stage) * width
                expected.update(range(first, first + width))
    return len(messages) == len(expected) and set(messages) == expected


def _check_messages(schedule: Schedule, messages: list[list[int]]) -> None:
    if not _messages_ok(schedule, [i for program in messages for i in program]):
        expected = _expected_messages(schedule)
        found: Counter[tuple[Op, int, int]] = Counter()
        for rank, program in enumerate(schedule.ranks):
            for index, a in enumerate(program):
                if a.op in COMM_OPS:
                    key = (a.op, a.stage, a.microbatch)
                    found[key] += 1
                    if found[key] > expected[key]:
                        why = "is repeated" if expected[key] else "crosses no rank boundary"
                        raise _fail(schedule, rank, index, why)
        for key, count in expected.items():
            if found[key] < count:
                raise _missing_message(schedule, key)
    if not _channel_order_ok(schedule, messages):
        _check_channel_order(schedule)


def _missing_message(schedule: Schedule, key: tuple[Op, int, int]) -> ScheduleError:
    """Name the missing send or receive and mark the compute that produces or consumes it."""
    op, s, m = key
    near = (Op.F,) if op in (Op.SEND_F, Op.RECV_F) else (Op.B, Op.BI)
    return _missing(
        schedule, schedule.stage_to_rank[s], f"{s}{op.value}{m} is missing", (near, s, m)
    )


def _channel_order_ok(schedule: Schedule, messages: list[list[int]]) -> bool:
    """Per directed channel, the receives are posted in the order of the sends."""
    place, width = schedule.stage_to_rank, schedule.num_microbatches
    size = schedule.num_stages * width
    # message: receiving stage * width + micro-batch, plus `size` for gradients
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, program_messages in enumerate(messages):
        for i in program_messages:
            code, rest = divmod(i, size)
            if code == _SEND_F:
                sends[(rank, place[rest // width + 1])].append(rest + width)
            elif code == _SEND_B:
                sends[(rank, place[rest // width - 1])].append(size + rest - width)
            elif code == _RECV_F:
                recvs[(place[rest // width - 1], rank)].append(rest)
            else:
                recvs[(place[rest // width + 1], rank)].append(size + rest)
    return sends == recvs


def _check_channel_order(schedule: Schedule) -> None:
    """Sends on a channel must be posted in the order the receiver posts their receives."""
    place = schedule.stage_to_rank
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, tuple[str, int, int]]]] = defaultdict(list)
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            if a.op is Op.SEND_F:
                sends[(rank, place[a.stage + 1])].append(("F", a.stage + 1, a.microbatch))
            elif a.op is Op.SEND_B:
                sends[(rank, place[a.stage - 1])].append(("B", a.stage - 1, a.microbatch))
            elif a.op is Op.RECV_F:
                recvs[(place[a.stage - 1], rank)].append((index, ("F", a.stage, a.microbatch)))
            elif a.op is Op.RECV_B:
                recvs[(place[a.stage + 1], rank)].append((index, ("B", a.stage, a.microbatch)))
    for (src, dst), posted in recvs.items():
        for (index, message), sent in zip(posted, sends[(src, dst)], strict=False):
            if message != sent:
                data = "activations" if sent[0] == "F" else "gradients"
                why = (
                    f"rank {src} sends the {data} for stage {sent[1]} micro-batch {sent[2]} "
                    f"first on this channel: post the receives from rank {src} in the order "
                    "of its sends"
                )
                raise _fail(schedule, dst, index, why)


def validate(schedule: Schedule) -> ValidationReport:
    """Prove `schedule` correct or raise `ScheduleError` with the grid, culprit marked."""
    _check_placement(schedule)
    ids = _ids(schedule)
    _check_coverage(schedule, ids)
    _check_local_order(schedule, ids)
    first_message = _SEND_F * schedule.num_stages * schedule.num_microbatches
    messages = [[i for i in program_ids if i >= first_message] for program_ids in ids]
    if any(messages):
        _check_messages(schedule, messages)
    summary = unit_summary(schedule)
    if not summary.completed:
        result = replay(schedule)  # again, with events, to draw the grid
        mark = frozenset((b.rank, b.index) for b in result.blocked)
        stuck = "; ".join(
            f"rank {b.rank} at {b.action} waits for {b.waiting_for}" for b in result.blocked
        )
        raise ScheduleError(
            f"{schedule.kind}: deadlock: {stuck}\n{format_grid(schedule, result=result, mark=mark)}"
        )
    span = summary.makespan
    busy = sum(summary.busy)
    bubble = 1.0 - busy / (span * schedule.num_ranks) if span else 0.0
    return ValidationReport(summary.peak_inflight, span, bubble)
