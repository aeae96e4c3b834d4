"""The validator: proves a schedule correct before anything runs, or shows where it breaks.

Checks, in order: every action sits on the rank that owns its stage; every micro-batch has
exactly one forward and one backward (full, or split into BI then BW) on every stage; each
rank orders its own actions legally; in a lowered schedule every cross-rank boundary has
exactly one send and one receive, and the sends on each directed channel are posted in the
order the peer posts their receives (so that in-order transports such as NCCL match them);
finally abstract execution (`replay`) proves the programs cannot deadlock.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from plait.schedule.grid import format_grid, format_program
from plait.schedule.ir import COMM_OPS, Op, Schedule
from plait.schedule.replay import replay

__all__ = ["ScheduleError", "ValidationReport", "validate"]


class ScheduleError(ValueError):
    """A schedule that is not correct; the message ends with the grid, the culprit marked."""


@dataclass(frozen=True)
class ValidationReport:
    """What validation learned under unit costs."""

    peak_inflight: tuple[int, ...]  # per rank: most micro-batches whose activations it holds
    makespan: float  # unit costs: forward 1, backward 2
    bubble_fraction: float  # idle share of ranks × makespan


def _fail(schedule: Schedule, rank: int, index: int, why: str) -> ScheduleError:
    grid = format_program(schedule, mark=frozenset({(rank, index)}))
    action = schedule.ranks[rank][index]
    return ScheduleError(f"{schedule.kind}: rank {rank} action {index} ({action}): {why}\n{grid}")


def _check_placement(schedule: Schedule) -> None:
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            if a.stage >= schedule.num_stages:
                raise _fail(schedule, rank, index, f"stage {a.stage} >= {schedule.num_stages}")
            if a.microbatch >= schedule.num_microbatches:
                raise _fail(schedule, rank, index, f"micro-batch {a.microbatch} out of range")
            owner = schedule.stage_to_rank[a.stage]
            if owner != rank:
                raise _fail(schedule, rank, index, f"stage {a.stage} is placed on rank {owner}")


def _check_coverage(schedule: Schedule) -> None:
    where: dict[tuple[Op, int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, program in enumerate(schedule.ranks):
        for index, a in enumerate(program):
            if a.op not in COMM_OPS:
                where[(a.op, a.stage, a.microbatch)].append((rank, index))
    for key, places in where.items():
        if len(places) > 1:
            raise _fail(schedule, *places[1], f"{key[0].value} repeated for this micro-batch")
    for s in range(schedule.num_stages):
        rank = schedule.stage_to_rank[s]
        for m in range(schedule.num_microbatches):
            has = {op for op in (Op.F, Op.B, Op.BI, Op.BW) if (op, s, m) in where}
            if Op.F not in has:
                raise _missing(schedule, rank, f"forward {s}F{m} is missing")
            if Op.B in has and has & {Op.BI, Op.BW}:
                raise _fail(schedule, *where[(Op.B, s, m)][0], "both full and split backward")
            if Op.B not in has and has & {Op.BI, Op.BW} != {Op.BI, Op.BW}:
                raise _missing(schedule, rank, f"backward of stage {s} micro-batch {m} is missing")


def _missing(schedule: Schedule, rank: int, why: str) -> ScheduleError:
    return ScheduleError(f"{schedule.kind}: rank {rank}: {why}\n{format_program(schedule)}")


_PREREQUISITE: dict[Op, tuple[Op, ...]] = {
    Op.B: (Op.F,),
    Op.BI: (Op.F,),
    Op.BW: (Op.BI,),
    Op.SEND_F: (Op.F,),
    Op.SEND_B: (Op.B, Op.BI),
}


def _check_local_order(schedule: Schedule) -> None:
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
                used = [position[(op, a.stage, a.microbatch)] for op in consumer
                        if (op, a.stage, a.microbatch) in position]
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


def _check_messages(schedule: Schedule) -> None:
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
            op, s, m = key
            raise _missing(schedule, schedule.stage_to_rank[s], f"{s}{op.value}{m} is missing")
    _check_channel_order(schedule)


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
                why = (
                    f"rank {src} sends {sent[1]}{sent[0]}{sent[2]} to rank {dst} at this point "
                    "of the channel: receives must be posted in the order of the sends"
                )
                raise _fail(schedule, dst, index, why)


def validate(schedule: Schedule) -> ValidationReport:
    """Prove `schedule` correct or raise `ScheduleError` with the grid, culprit marked."""
    _check_placement(schedule)
    _check_coverage(schedule)
    _check_local_order(schedule)
    if any(a.op in COMM_OPS for p in schedule.ranks for a in p):
        _check_messages(schedule)
    result = replay(schedule)
    if not result.completed:
        mark = frozenset((b.rank, b.index) for b in result.blocked)
        stuck = "; ".join(f"rank {b.rank} at {b.action} waits for {b.waiting_for}"
                          for b in result.blocked)
        raise ScheduleError(
            f"{schedule.kind}: deadlock: {stuck}\n{format_grid(schedule, result=result, mark=mark)}"
        )
    span = result.makespan
    busy = sum(result.busy(r) for r in range(schedule.num_ranks))
    bubble = 1.0 - busy / (span * schedule.num_ranks) if span else 0.0
    return ValidationReport(result.peak_inflight, span, bubble)
