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

# Data that crosses a stage boundary: activations flow forward, gradients backward.
_ACTIVATIONS, _GRADIENTS = 0, 1
_DIRECTION = {Op.F: _ACTIVATIONS, Op.B: _GRADIENTS, Op.BI: _GRADIENTS}  # who sends / consumes
_SEND_OP = (Op.SEND_F, Op.SEND_B)
_RECV_OP = (Op.RECV_F, Op.RECV_B)


def compute_only(schedule: Schedule) -> Schedule:
    """Strip every send and receive."""
    return schedule.with_programs([[a for a in p if a.op not in COMM_OPS] for p in schedule.ranks])


class _Links:
    """Per stage and direction: the rank a stage sends its output to, and the rank its input
    comes from, or -1 when that neighbour is on the same rank (or absent)."""

    def __init__(self, schedule: Schedule) -> None:
        place, last = schedule.stage_to_rank, schedule.num_stages - 1
        stages = range(schedule.num_stages)
        after = [place[s + 1] if s < last and place[s + 1] != place[s] else -1 for s in stages]
        before = [place[s - 1] if s > 0 and place[s - 1] != place[s] else -1 for s in stages]
        self.send_to = (after, before)  # [direction][stage]
        self.recv_from = (before, after)
        self.width = schedule.num_microbatches
        self.num_stages = schedule.num_stages

    def message(self, direction: int, stage: int, microbatch: int) -> int:
        """The id of the message that receiving `stage` consumes: direction, stage, mb."""
        return (direction * self.num_stages + stage) * self.width + microbatch

    def receive(self, message: int) -> Action:
        rest, microbatch = divmod(message, self.width)
        direction, stage = divmod(rest, self.num_stages)
        return Action(_RECV_OP[direction], stage, microbatch)


def _channel_orders(schedule: Schedule, links: _Links) -> dict[tuple[int, int], deque[int]]:
    """Per (source, destination): the messages in the order the source sends them."""
    orders: dict[tuple[int, int], deque[int]] = defaultdict(deque)
    step = (1, -1)  # the receiving stage, per direction
    for rank, program in enumerate(schedule.ranks):
        for a in program:
            direction = _DIRECTION.get(a.op)
            if direction is not None:
                dst = links.send_to[direction][a.stage]
                if dst >= 0:
                    receiver = a.stage + step[direction]
                    orders[(rank, dst)].append(links.message(direction, receiver, a.microbatch))
    return orders


def _receives(
    rank: int, program: tuple[Action, ...], links: _Links, orders: dict[tuple[int, int], deque[int]]
) -> list[list[Action]]:
    """Per compute action, the receives to post for it: its own input, preceded by every
    message that the source sends on the same channel before it (so the order matches)."""
    posted: set[int] = set()
    posts: list[list[Action]] = []
    for a in program:
        batch: list[Action] = []
        direction = _DIRECTION.get(a.op)
        src = -1 if direction is None else links.recv_from[direction][a.stage]
        if src >= 0:
            assert direction is not None
            message = links.message(direction, a.stage, a.microbatch)
            queue = orders[(src, rank)]
            while message not in posted:
                if not queue:
                    raise ValueError(
                        f"{a} on rank {rank} consumes data that rank {src} never produces: "
                        "validate the compute-only schedule first"
                    )
                posted.add(queue[0])
                batch.append(links.receive(queue.popleft()))
        posts.append(batch)
    return posts


def add_communication(schedule: Schedule, *, prefetch: bool = True) -> Schedule:
    """Insert SEND/RECV actions into a compute-only schedule (see the module docstring)."""
    base = compute_only(schedule)
    links = _Links(base)
    orders = _channel_orders(base, links)
    programs = []
    for rank, program in enumerate(base.ranks):
        posts = _receives(rank, program, links, orders)
        if prefetch and len(posts) > 1:  # post receives one compute action ahead
            posts = [posts[0] + posts[1], *posts[2:], []]
        out: list[Action] = []
        for a, batch in zip(program, posts, strict=True):
            out.extend(batch)
            out.append(a)
            direction = _DIRECTION.get(a.op)
            if direction is not None and links.send_to[direction][a.stage] >= 0:
                out.append(Action(_SEND_OP[direction], a.stage, a.microbatch))
        programs.append(out)
    return base.with_programs(programs)
