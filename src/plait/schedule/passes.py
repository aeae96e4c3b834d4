"""Lowering passes: functions that take a schedule and return a new one.

`add_communication` turns a compute-only schedule into the program the runtime executes:
each send right after the compute that produces its data, each receive posted one compute
action ahead of its consumer (so the transfer overlaps that compute), and the receives on
every directed channel posted in the order the peer sends (which in-order transports such
as NCCL require, and the validator checks).
"""

from __future__ import annotations

from collections import defaultdict, deque

from plait.schedule.ir import COMM_OPS, Action, Op, Schedule

__all__ = ["add_communication", "compute_only"]

Message = tuple[Op, int, int]  # (RECV_F or RECV_B, receiving stage, micro-batch)


def compute_only(schedule: Schedule) -> Schedule:
    """Strip every send and receive."""
    return schedule.with_programs([[a for a in p if a.op not in COMM_OPS] for p in schedule.ranks])


def _sends(schedule: Schedule, a: Action) -> list[Action]:
    place, last = schedule.stage_to_rank, schedule.num_stages - 1
    if a.op is Op.F and a.stage < last and place[a.stage + 1] != place[a.stage]:
        return [Action(Op.SEND_F, a.stage, a.microbatch)]
    if a.op in (Op.B, Op.BI) and a.stage > 0 and place[a.stage - 1] != place[a.stage]:
        return [Action(Op.SEND_B, a.stage, a.microbatch)]
    return []


def _needed(schedule: Schedule, a: Action) -> tuple[int, Message] | None:
    """The (source rank, message) that compute action `a` consumes from another rank."""
    place, last = schedule.stage_to_rank, schedule.num_stages - 1
    if a.op is Op.F and a.stage > 0 and place[a.stage - 1] != place[a.stage]:
        return place[a.stage - 1], (Op.RECV_F, a.stage, a.microbatch)
    if a.op in (Op.B, Op.BI) and a.stage < last and place[a.stage + 1] != place[a.stage]:
        return place[a.stage + 1], (Op.RECV_B, a.stage, a.microbatch)
    return None


def _channel_orders(schedule: Schedule) -> dict[tuple[int, int], deque[Message]]:
    """Per (source, destination): the messages in the order the source sends them."""
    place = schedule.stage_to_rank
    orders: dict[tuple[int, int], deque[Message]] = defaultdict(deque)
    for rank, program in enumerate(schedule.ranks):
        for a in program:
            for send in _sends(schedule, a):
                if send.op is Op.SEND_F:
                    orders[(rank, place[a.stage + 1])].append((Op.RECV_F, a.stage + 1, a.microbatch))
                else:
                    orders[(rank, place[a.stage - 1])].append((Op.RECV_B, a.stage - 1, a.microbatch))
    return orders


def add_communication(schedule: Schedule, *, prefetch: bool = True) -> Schedule:
    """Insert SEND/RECV actions into a compute-only schedule (see the module docstring)."""
    base = compute_only(schedule)
    orders = _channel_orders(base)
    programs = []
    for rank, program in enumerate(base.ranks):
        posted: set[Message] = set()
        posts: list[list[Action]] = []
        for a in program:
            needed = _needed(base, a)
            batch: list[Action] = []
            if needed is not None:
                src, message = needed
                queue = orders[(src, rank)]
                while message not in posted:
                    op, stage, mb = queue.popleft()
                    posted.add((op, stage, mb))
                    batch.append(Action(op, stage, mb))
            posts.append(batch)
        out: list[Action] = []
        for i, a in enumerate(program):
            if prefetch:
                if i == 0:
                    out.extend(posts[0])
                if i + 1 < len(program):
                    out.extend(posts[i + 1])
            else:
                out.extend(posts[i])
            out.append(a)
            out.extend(_sends(base, a))
        programs.append(out)
    return base.with_programs(programs)
