"""The checks of a whole run (an unrolled schedule): coverage, each rank's local order,
one send and one receive per message, and the channel order of the sends.

Each check first runs a fast test over integer action ids (a 64-rank, 512-micro-batch
schedule has 200 000 actions); only when that test fails does the plain, action-by-action
scan run, to name the first culprit in the error (`ScheduleError`, with the grid).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from operator import attrgetter

from plait.schedule.grid import format_program
from plait.schedule.ir import COMPUTE_OPS, P2P_OPS, Op, Schedule

__all__ = [
    "ScheduleError",
    "check_coverage",
    "check_local_order",
    "check_messages",
    "check_range",
    "fail",
    "first_message",
    "ids",
    "missing",
]


class ScheduleError(ValueError):
    """A schedule that is not correct; the message ends with the grid, the culprit marked."""


# Action ids: (code * num_stages + stage) * num_microbatches + microbatch, with these codes;
# compute ops come first, so that an id at or above 4 * stages * micro-batches is a message.
_CODE = {Op.F: 0, Op.B: 1, Op.BI: 2, Op.BW: 3, Op.SEND_F: 4, Op.RECV_F: 5, Op.SEND_B: 6}
_CODE[Op.RECV_B] = 7
_F, _B, _BI, _BW, _SEND_F, _RECV_F, _SEND_B, _RECV_B = range(8)
_microbatch_of = attrgetter("microbatch")


def fail(schedule: Schedule, rank: int, index: int, why: str) -> ScheduleError:
    grid = format_program(schedule, mark=frozenset({(rank, index)}))
    action = schedule.ranks[rank][index]
    return ScheduleError(f"{schedule.kind}: rank {rank} action {index} ({action}): {why}\n{grid}")


def missing(
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


# ------------------------------------------------------------- a whole run
def ids(schedule: Schedule) -> list[list[int]]:
    """Per rank, the integer id of every compute and message action (others get -1)."""
    width, num_stages = schedule.num_microbatches, schedule.num_stages
    code = _CODE
    return [
        [
            (code[a.op] * num_stages + a.stage) * width + a.microbatch if a.op in code else -1
            for a in program
        ]
        for program in schedule.ranks
    ]


def check_range(schedule: Schedule) -> None:
    for rank, program in enumerate(schedule.ranks):
        if not program or max(map(_microbatch_of, program)) < schedule.num_microbatches:
            continue
        for index, a in enumerate(program):
            if a.microbatch >= schedule.num_microbatches:
                raise fail(schedule, rank, index, f"micro-batch {a.microbatch} out of range")


def _expected_compute(schedule: Schedule) -> set[int] | None:
    """Stage * width + micro-batch of every (stage, micro-batch) that must run; None when
    every micro-batch visits every stage (the common case, checked by counting)."""
    pipelines = schedule.graph[0]
    if len(pipelines) == 1 and len(pipelines[0]) == schedule.num_stages:
        return None
    width = schedule.num_microbatches
    return {s * width + x for x in range(width) for s in schedule.path(x)}


def _coverage_ok(schedule: Schedule, ids: list[list[int]]) -> bool:
    """No compute action repeated; every (stage, micro-batch) of a path has F and B, or F,
    BI and BW."""
    size = schedule.num_stages * schedule.num_microbatches
    by_code: list[list[int]] = [[], [], [], []]  # F, B, BI, BW: stage * width + microbatch
    for program_ids in ids:
        for i in program_ids:
            if i >= 0:
                code, rest = divmod(i, size)
                if code <= _BW:
                    by_code[code].append(rest)
    f, b, bi, bw = (set(x) for x in by_code)
    if sum(map(len, by_code)) != len(f) + len(b) + len(bi) + len(bw):
        return False  # a repeat
    expected = _expected_compute(schedule)
    if expected is None:
        return len(f) == size and bi == bw and not (b & bi) and len(b) + len(bi) == size
    return f == expected and bi == bw and not (b & bi) and (b | bi) == expected


def check_coverage(schedule: Schedule, ids: list[list[int]]) -> None:
    if _coverage_ok(schedule, ids):
        return
    where: dict[tuple[Op, int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            if a.op in COMPUTE_OPS:
                where[(a.op, a.stage, a.microbatch)].append((rank, index))
    for key, places in where.items():
        if len(places) > 1:
            raise fail(schedule, *places[1], f"{key[0].value} repeated for this micro-batch")
    backward = (Op.B, Op.BI, Op.BW)
    for m in range(schedule.num_microbatches):
        path = set(schedule.path(m))
        for s in range(schedule.num_stages):
            rank = schedule.stage_to_rank[s]
            has = {op for op in (Op.F, Op.B, Op.BI, Op.BW) if (op, s, m) in where}
            if s not in path:
                if has:
                    op = sorted(has)[0]
                    why = f"micro-batch {m} does not pass through stage {s}"
                    raise fail(schedule, *where[(op, s, m)][0], why)
                continue
            if Op.F not in has:
                raise missing(schedule, rank, f"forward {s}F{m} is missing", (backward, s, m))
            if Op.B in has and has & {Op.BI, Op.BW}:
                raise fail(schedule, *where[(Op.B, s, m)][0], "both full and split backward")
            if Op.B not in has and has & {Op.BI, Op.BW} != {Op.BI, Op.BW}:
                why = f"backward of stage {s} micro-batch {m} is missing"
                raise missing(schedule, rank, why, ((Op.F, Op.BI, Op.BW), s, m))


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
            if i < 0:
                continue
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


def check_local_order(schedule: Schedule, ids: list[list[int]]) -> None:
    if _local_order_ok(schedule, ids):
        return
    for rank, program in enumerate(schedule.ranks):
        seen: set[tuple[Op, int, int]] = set()
        for index, a in enumerate(program):
            needs = _PREREQUISITE.get(a.op, ())
            if needs and not any((op, a.stage, a.microbatch) in seen for op in needs):
                names = " or ".join(f"{a.stage}{op.value}{a.microbatch}" for op in needs)
                raise fail(schedule, rank, index, f"comes before {names} on this rank")
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
                    raise fail(schedule, rank, index, "is posted after the action that uses it")


def _remote_edges(schedule: Schedule) -> list[tuple[int, int]]:
    """(stage, next stage) of every stage-graph edge between two ranks."""
    place, after = schedule.stage_to_rank, schedule.graph[1]
    return [(s, t) for s, t in enumerate(after) if t >= 0 and place[s] != place[t]]


def _expected_messages(schedule: Schedule) -> Counter[tuple[Op, int, int]]:
    expected: Counter[tuple[Op, int, int]] = Counter()
    for s, t in _remote_edges(schedule):
        for m in range(schedule.num_microbatches):
            if s in schedule.path(m):
                expected.update([(Op.SEND_F, s, m), (Op.RECV_F, t, m)])
                expected.update([(Op.SEND_B, t, m), (Op.RECV_B, s, m)])
    return expected


def _messages_ok(schedule: Schedule, messages: list[int]) -> bool:
    """Exactly one send and one receive per message across each rank boundary."""
    width, num_stages = schedule.num_microbatches, schedule.num_stages
    expected: set[int] = set()
    paths = schedule.graph[0]
    for s, t in _remote_edges(schedule):
        line = next(i for i, p in enumerate(paths) if s in p)
        mbs = [x for x in range(width) if x % len(paths) == line]
        for code, stage in ((_SEND_F, s), (_RECV_F, t), (_SEND_B, t), (_RECV_B, s)):
            first = (code * num_stages + stage) * width
            expected.update(first + x for x in mbs)
    return len(messages) == len(expected) and set(messages) == expected


def check_messages(schedule: Schedule, messages: list[list[int]]) -> None:
    if not _messages_ok(schedule, [i for program in messages for i in program]):
        expected = _expected_messages(schedule)
        found: Counter[tuple[Op, int, int]] = Counter()
        for rank, program in enumerate(schedule.ranks):
            for index, a in enumerate(program):
                if a.op in P2P_OPS:
                    key = (a.op, a.stage, a.microbatch)
                    found[key] += 1
                    if found[key] > expected[key]:
                        why = "is repeated" if expected[key] else "crosses no rank boundary"
                        raise fail(schedule, rank, index, why)
        for key, count in expected.items():
            if found[key] < count:
                raise _missing_message(schedule, key)
    if not _channel_order_ok(schedule, messages):
        _check_channel_order(schedule)


def _missing_message(schedule: Schedule, key: tuple[Op, int, int]) -> ScheduleError:
    """Name the missing send or receive and mark the compute that produces or consumes it."""
    op, s, m = key
    near = (Op.F,) if op in (Op.SEND_F, Op.RECV_F) else (Op.B, Op.BI)
    return missing(
        schedule, schedule.stage_to_rank[s], f"{s}{op.value}{m} is missing", (near, s, m)
    )


def _channel_order_ok(schedule: Schedule, messages: list[list[int]]) -> bool:
    """Per directed channel, the receives are posted in the order of the sends."""
    place, width = schedule.stage_to_rank, schedule.num_microbatches
    _, after, before = schedule.graph
    size = schedule.num_stages * width
    # message: receiving stage * width + micro-batch, plus `size` for gradients
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, program_messages in enumerate(messages):
        for i in program_messages:
            code, rest = divmod(i, size)
            stage, x = divmod(rest, width)
            if code == _SEND_F:
                sends[(rank, place[after[stage]])].append(after[stage] * width + x)
            elif code == _SEND_B:
                sends[(rank, place[before[stage]])].append(size + before[stage] * width + x)
            elif code == _RECV_F:
                recvs[(place[before[stage]], rank)].append(rest)
            else:
                recvs[(place[after[stage]], rank)].append(size + rest)
    return sends == recvs


def _check_channel_order(schedule: Schedule) -> None:
    """Sends on a channel must be posted in the order the receiver posts their receives."""
    place = schedule.stage_to_rank
    _, after, before = schedule.graph
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, tuple[str, int, int]]]] = defaultdict(list)
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            s, x = a.stage, a.microbatch
            if a.op is Op.SEND_F:
                sends[(rank, place[after[s]])].append(("F", after[s], x))
            elif a.op is Op.SEND_B:
                sends[(rank, place[before[s]])].append(("B", before[s], x))
            elif a.op is Op.RECV_F:
                recvs[(place[before[s]], rank)].append((index, ("F", s, x)))
            elif a.op is Op.RECV_B:
                recvs[(place[after[s]], rank)].append((index, ("B", s, x)))
    for (src, dst), posted in recvs.items():
        for (index, message), sent in zip(posted, sends[(src, dst)], strict=False):
            if message != sent:
                data = "activations" if sent[0] == "F" else "gradients"
                why = (
                    f"rank {src} sends the {data} for stage {sent[1]} micro-batch {sent[2]} "
                    f"first on this channel: post the receives from rank {src} in the order "
                    "of its sends"
                )
                raise fail(schedule, dst, index, why)


def first_message(schedule: Schedule) -> int:
    """The lowest id of a send or receive: ids below it are compute actions."""
    return _SEND_F * schedule.num_stages * schedule.num_microbatches
