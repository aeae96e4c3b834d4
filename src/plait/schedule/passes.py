"""Lowering passes: functions that take a schedule and return a new one.

`add_reductions` places each stage's data-parallel gradient reduction (`REDUCE`) right
after the last backward whose gradients the stage's next `UPDATE` applies, so that the
reduction overlaps whatever the rank does before the update.

`add_communication` turns a compute-only schedule into the program the runtime executes:
each send right after the compute that produces its data, each receive posted one action
ahead of its consumer (so the transfer overlaps that action; never across the start of a
window), and the receives on every directed channel posted in the order the peer sends
(which in-order transports such as NCCL require, and the validator checks). A window's
program repeats, so the channel order is that of the unbounded stream: a message is
placed by its position in the sender's stream of messages on the channel, and a window
posts the messages that follow those the previous window posted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from plait.schedule.ir import COMM_OPS, COMPUTE_OPS, Action, Op, Schedule

__all__ = [
    "add_communication",
    "add_reductions",
    "completing_backwards",
    "compute_only",
    "forward_only",
]

# Data that crosses a stage boundary: activations flow forward, gradients backward.
_ACTIVATIONS, _GRADIENTS = 0, 1
_DIRECTION = {Op.F: _ACTIVATIONS, Op.B: _GRADIENTS, Op.BI: _GRADIENTS}  # who sends / consumes
_SEND_OP = (Op.SEND_F, Op.SEND_B)
_RECV_OP = (Op.RECV_F, Op.RECV_B)


def compute_only(schedule: Schedule) -> Schedule:
    """Strip every send, receive and reduction (what a generator returns)."""
    return schedule.with_programs([[a for a in p if a.op not in COMM_OPS] for p in schedule.ranks])


def forward_only(schedule: Schedule, num_microbatches: int) -> Schedule:
    """The forward-only program of evaluation over micro-batches 0..num_microbatches-1:
    micro-batch by micro-batch along its path of stages, each stage's receive (when its
    input comes from another rank), forward and send. Not a window of the training
    schedule, whose windows interleave backwards and updates (and, asynchronous, overlap):
    here every rank meets its peers in the same order and sends are asynchronous, so it
    cannot deadlock."""
    programs: list[list[Action]] = [[] for _ in range(schedule.num_ranks)]
    owner = schedule.stage_to_rank
    for m in range(num_microbatches):
        for s in schedule.path(m):
            before, after = schedule.prev_stage(s), schedule.next_stage(s)
            program = programs[owner[s]]
            if before is not None and owner[before] != owner[s]:
                program.append(Action(Op.RECV_F, s, m))
            program.append(Action(Op.F, s, m))
            if after is not None and owner[after] != owner[s]:
                program.append(Action(Op.SEND_F, s, m))
    return Schedule(
        kind=f"{schedule.kind}-forward",
        num_ranks=schedule.num_ranks,
        num_microbatches=max(1, num_microbatches),
        stage_to_rank=schedule.stage_to_rank,
        ranks=tuple(tuple(p) for p in programs),
        num_chunks=schedule.num_chunks,
        pipelines=schedule.pipelines,
    )


def add_reductions(schedule: Schedule) -> Schedule:
    """Insert `REDUCE s` after the last backward of stage s before each `UPDATE s` (or just
    before the update when no backward of s precedes it since the previous one)."""
    programs = []
    b, bw, update, reduction = Op.B, Op.BW, Op.UPDATE, Op.REDUCE  # not looked up per action
    for program in schedule.ranks:
        out: list[Action] = [a for a in program if a.op is not reduction]
        last: dict[int, int] = {}  # stage -> position in `out` after its latest backward
        placed: list[tuple[int, Action]] = []
        for i, a in enumerate(out):
            if a.op is b or a.op is bw:
                last[a.stage] = i + 1
            elif a.op is update:
                at = last.pop(a.stage, i)
                placed.append((at, Action(Op.REDUCE, a.stage, a.microbatch)))
        for at, reduce in sorted(placed, key=lambda item: item[0], reverse=True):
            out.insert(at, reduce)
        programs.append(out)
    return schedule.with_programs(programs)


def completing_backwards(program: Sequence[Action]) -> set[int]:
    """Indices of the backwards (B or BW) after which a stage's gradients for its next
    REDUCE are complete (a data-parallel reducer listens during those)."""
    latest: dict[int, int] = {}
    out: set[int] = set()
    for i, a in enumerate(program):
        if a.op is Op.B or a.op is Op.BW:
            latest[a.stage] = i
        elif a.op is Op.REDUCE and a.stage in latest:
            out.add(latest.pop(a.stage))
    return out


class _Links:
    """Per stage and direction: the rank a stage sends its output to, and the rank its
    input comes from, or -1 when that neighbour is on the same rank (or absent)."""

    def __init__(self, schedule: Schedule) -> None:
        place = schedule.stage_to_rank
        _, after_of, before_of = schedule.graph

        def remote(stage: int, other: int) -> int:
            return place[other] if other >= 0 and place[other] != place[stage] else -1

        stages = range(schedule.num_stages)
        after = [remote(s, after_of[s]) for s in stages]
        before = [remote(s, before_of[s]) for s in stages]
        self.send_to = (after, before)  # [direction][stage]
        self.recv_from = (before, after)
        self.neighbour = (after_of, before_of)  # [direction][stage]: the receiving stage


# A message: (direction, receiving stage, micro-batch relative to the window)
_Message = tuple[int, int, int]


class _Channel:
    """The messages one rank sends another in one window, in the order it sends them."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.sent: list[_Message] = []
        self.index: dict[tuple[int, int, int], int] = {}  # (dir, stage, mb mod m) -> i

    def add(self, message: _Message) -> None:
        direction, stage, mb = message
        self.index[(direction, stage, mb % self.width)] = len(self.sent)
        self.sent.append(message)

    def position(self, message: _Message) -> int:
        """Where `message` (as the receiver's window names it) falls in the sender's stream,
        counted from the sender's messages of the receiver's window."""
        direction, stage, mb = message
        i = self.index.get((direction, stage, mb % self.width))
        if i is None:
            raise ValueError(
                f"stage {stage} consumes micro-batch {mb}'s data that no rank sends it: "
                "validate the compute-only schedule first"
            )
        windows = (mb - self.sent[i][2]) // self.width
        return windows * len(self.sent) + i


def _channels(schedule: Schedule, links: _Links) -> dict[tuple[int, int], _Channel]:
    """Per (source, destination): the window's messages in the order the source sends them."""
    channels: dict[tuple[int, int], _Channel] = defaultdict(
        lambda: _Channel(schedule.num_microbatches)
    )
    for rank, program in enumerate(schedule.ranks):
        for a in program:
            direction = _DIRECTION.get(a.op)
            if direction is not None:
                dst = links.send_to[direction][a.stage]
                if dst >= 0:
                    receiver = links.neighbour[direction][a.stage]
                    channels[(rank, dst)].add((direction, receiver, a.microbatch))
    return channels


def _receives(
    rank: int,
    program: tuple[Action, ...],
    links: _Links,
    channels: dict[tuple[int, int], _Channel],
    width: int,
) -> dict[int, list[Action]]:
    """Per action that consumes another rank's data (by its index in `program`), the
    receives to post for it: its own input, preceded by every message the source sends on
    the same channel before it (so the order matches)."""
    recv_from = links.recv_from
    # (index, source rank, the message's position in its sender's stream), found once
    found: list[tuple[int, int, int]] = []
    last: dict[int, int] = {}  # per source: the furthest position this window consumes
    for index, a in enumerate(program):
        direction = _DIRECTION.get(a.op)
        if direction is None:
            continue
        src = recv_from[direction][a.stage]
        if src < 0:
            continue
        top = channels[(src, rank)].position((direction, a.stage, a.microbatch))
        found.append((index, src, top))
        last[src] = max(last.get(src, top), top)
    # the previous window posted up to its last message: one window's worth before ours
    posted = {src: top - len(channels[(src, rank)].sent) for src, top in last.items()}
    posts: dict[int, list[Action]] = {}
    for index, src, top in found:
        channel = channels[(src, rank)]
        sent, count = channel.sent, len(channel.sent)
        batch: list[Action] = []
        for position in range(posted[src] + 1, top + 1):
            windows, i = divmod(position, count)  # the message at `position`
            direction, stage, mb = sent[i]
            mb += windows * channel.width
            if mb >= width:
                raise ValueError(
                    f"rank {rank} would post a receive for micro-batch {mb} of a later "
                    "window: reorder the window so each rank consumes messages in the "
                    "order its peer sends them"
                )
            batch.append(Action(_RECV_OP[direction], stage, mb))
        posted[src] = max(posted[src], top)
        posts[index] = batch
    return posts


def _one_compute_ahead(
    program: tuple[Action, ...], posts: dict[int, list[Action]]
) -> dict[int, list[Action]]:
    """Move each compute action's receives before the compute action preceding it (the
    first two compute actions' both go first)."""
    compute = [i for i, a in enumerate(program) if a.op in COMPUTE_OPS]
    shifted: dict[int, list[Action]] = {}
    for j, i in enumerate(compute):
        batch = posts.get(i)
        if batch:
            shifted.setdefault(compute[max(j - 1, 0)], []).extend(batch)
    return shifted


def add_communication(schedule: Schedule, *, prefetch: bool = True) -> Schedule:
    """Insert SEND/RECV actions into a compute-only schedule (see the module docstring);
    reductions already placed are kept."""
    base = schedule.with_programs(
        [[a for a in p if a.op not in COMM_OPS or a.op is Op.REDUCE] for p in schedule.ranks]
    )
    links = _Links(base)
    channels = _channels(base, links)
    programs = []
    for rank, program in enumerate(base.ranks):
        posts = _receives(rank, program, links, channels, base.num_microbatches)
        if prefetch:
            posts = _one_compute_ahead(program, posts)
        out: list[Action] = []
        send_to = links.send_to
        for index, a in enumerate(program):
            batch = posts.get(index)
            if batch:
                out.extend(batch)
            out.append(a)
            direction = _DIRECTION.get(a.op)
            if direction is not None and send_to[direction][a.stage] >= 0:
                out.append(Action(_SEND_OP[direction], a.stage, a.microbatch))
        programs.append(out)
    return base.with_programs(programs)
