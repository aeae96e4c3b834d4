"""Lowering: one rank's actions of a window turned into the concrete instructions it runs.

`lower(schedule, rank, actions)` resolves, once per window, what the runtime would
otherwise work out action by action: for each message its peer rank and the channel it
travels on, for each compute action where its input comes from (the micro-batch's data, a
stage on this rank, a received message) and where its output goes (the loss, a stage on
this rank, a message), and which backwards complete a stage's gradients for its next
reduction. Consecutive sends on one channel are one `Batch`, issued together
(`torch.distributed.batch_isend_irecv`, as torch.distributed.pipelining batches a step's
messages); a receive is a batch of its own (see `_messages`).

Channels. Every message travels on the channel of its (sender, receiver) pair of pipeline
ranks, and the runtime gives each channel a process group of its own. NCCL runs a rank's
point-to-point operations of one communicator on one stream, in the order they were
issued, and a send does not finish before its peer's receive runs: with one process group
for the whole pipeline, a rank that posts a receive from its peer ahead of a send to it (as
a pipeline posts receives early, to overlap them with compute) blocks the send behind the
receive, and when the peer does the same the two wait for each other forever (1F1B on two
ranks: rank 0 posts the receive of 0B0 before sending 0F1, rank 1 posts 1F1's receive
before sending 1B0). With one channel per directed pair, each is a first-in, first-out
queue of its own, which is exactly the model the validator's replay proves deadlock-free
(`plait.schedule.replay`: sends on a channel travel one after another in the sender's
order; receives are posted in that order, `plait.schedule.checks`). `stream_deadlock`
replays lowered programs under NCCL's rule, one stream per rank and process group, to show
it.

Pure: integers and actions in, instructions out; nothing here touches torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from plait.schedule.ir import P2P_OPS, Action, Op, Schedule
from plait.schedule.passes import completing_backwards

__all__ = [
    "Batch",
    "Message",
    "Program",
    "Step",
    "channel",
    "lower",
    "stream_deadlock",
]

# where a compute action's input comes from / its output goes
DATA, LOCAL, REMOTE, LOSS, NONE = "data", "local", "remote", "loss", "none"
_SENDS = (Op.SEND_F, Op.SEND_B)


def channel(src: int, dst: int) -> tuple[int, int]:
    """The channel a message from pipeline rank `src` to `dst` travels on: the pair."""
    return src, dst


class Message(NamedTuple):
    """One point-to-point message: its SEND or RECV action, the peer rank and the stage
    there, and its channel (the sending and the receiving rank)."""

    action: Action
    peer: int
    peer_stage: int
    channel: tuple[int, int]

    @property
    def is_send(self) -> bool:
        return self.action.op in _SENDS

    @property
    def key(self) -> tuple[Op, int, int]:
        """(op, stage, micro-batch) of its action: what the other side of this rank looks
        it up by (the outgoing data of a send, the consumer of a receive)."""
        a = self.action
        return a.op, a.stage, a.microbatch


class Batch(NamedTuple):
    """Messages issued together, all on one channel, in program order."""

    messages: tuple[Message, ...]
    channel: tuple[int, int]


class Step(NamedTuple):
    """One action as the runtime runs it. `batch` is set on the first point-to-point action
    of a batch (the others of the batch carry none); compute actions say where their input
    comes from (`source`: data, local or remote for a forward; loss, local or remote for
    the output gradients of a backward) and where their output goes (`target`: loss,
    local or remote for a forward; none, local or remote for the input gradients of a
    backward); `completes` marks a backward after which its stage's gradients for the
    next reduction are whole."""

    position: int  # in the window's actions
    action: Action
    batch: Batch | None = None
    source: str = NONE
    target: str = NONE
    completes: bool = False


class Program(NamedTuple):
    """A rank's lowered window: its steps in program order."""

    rank: int
    steps: tuple[Step, ...]

    @property
    def batches(self) -> list[Batch]:
        return [s.batch for s in self.steps if s.batch is not None]


def lower(schedule: Schedule, rank: int, actions: Sequence[Action]) -> Program:
    """`rank`'s `actions` (a concrete window of its stream, or a whole unrolled run) as the
    runtime runs them."""
    place = schedule.stage_to_rank
    _, after_of, before_of = schedule.graph

    def where(other: int, none: str) -> str:
        return none if other < 0 else LOCAL if place[other] == rank else REMOTE

    completes = completing_backwards(actions)
    steps: list[Step] = []
    i, n = 0, len(actions)
    while i < n:
        a = actions[i]
        op = a.op
        if op in P2P_OPS:
            run = _messages(schedule, rank, actions, i)
            steps.append(Step(i, a, Batch(tuple(run), run[0].channel)))
            steps += [Step(i + k, m.action) for k, m in enumerate(run[1:], start=1)]
            i += len(run)
            continue
        if op is Op.F:
            before, after = before_of[a.stage], after_of[a.stage]
            steps.append(Step(i, a, None, where(before, DATA), where(after, LOSS)))
        elif op is Op.B or op is Op.BI:
            before, after = before_of[a.stage], after_of[a.stage]
            step = Step(i, a, None, where(after, LOSS), where(before, NONE), i in completes)
            steps.append(step)
        else:
            steps.append(Step(i, a, completes=i in completes))
        i += 1
    return Program(rank, tuple(steps))


def _messages(
    schedule: Schedule, rank: int, actions: Sequence[Action], start: int
) -> list[Message]:
    """The batch that starts at `start`: a receive alone, or the run of consecutive sends
    on one channel. Receives are not batched: torch completes a batch's operations
    together, so a batch holding two receives would hold the first one's data back until
    the second arrived, and the second may depend (through the peer) on what this rank
    computes from the first."""
    first = _message(schedule, rank, actions[start])
    out = [first]
    if not first.is_send:
        return out
    for a in actions[start + 1 :]:
        if a.op not in _SENDS:
            break
        message = _message(schedule, rank, a)
        if message.channel != first.channel:
            break
        out.append(message)
    return out


def _message(schedule: Schedule, rank: int, a: Action) -> Message:
    _, after_of, before_of = schedule.graph
    forward = a.op is Op.SEND_F or a.op is Op.RECV_B  # towards the next stage
    other = after_of[a.stage] if forward else before_of[a.stage]
    if other < 0:
        raise ValueError(f"{a} on rank {rank} has no peer stage: the schedule is malformed")
    peer = schedule.stage_to_rank[other]
    src, dst = (rank, peer) if a.op in _SENDS else (peer, rank)
    return Message(a, peer, other, channel(src, dst))


# ------------------------------------------------------------------ NCCL's rule
def stream_deadlock(run: Schedule, *, shared_channel: bool = False) -> str | None:
    """Replay the lowered programs of `run` (a whole run: `plait.schedule.stream.unroll`'s,
    or a synchronous schedule itself) under NCCL's rule; None when they finish, else which
    rank stops where. `shared_channel`: every message of a rank on one stream (one process
    group for the pipeline), to show what the channels prevent.

    The rule: each rank issues its program in order without blocking (waits are
    stream-ordered); a compute action runs after the one before it on its rank and after
    every receive it consumes; the batches a rank issues on one stream (a process group)
    run one after another, a batch starting once the one before it finished and the data
    of its sends exists; a message completes when both its send's batch and its receive's
    batch have started (a rendezvous), and a batch finishes when all its messages
    completed."""
    programs = [lower(run, r, run.ranks[r]) for r in range(run.num_ranks)]
    return _Streams(programs, shared_channel).deadlock()


class _Streams:
    """State of `stream_deadlock`'s replay, driven by a work list: a rank is looked at
    again when a receive it may consume arrives, a stream when the data of its head batch
    may exist or its peer's head changed. Batches and messages are numbered; each message
    knows its other end, so a rendezvous is two look-ups."""

    def __init__(self, programs: list[Program], shared: bool) -> None:
        # computes[r]: (the received key it waits for or None, the data key it makes)
        self.computes: list[list[tuple[tuple[int, Op, int, int] | None, tuple[int, Op, int, int]]]]
        self.computes = [[] for _ in programs]
        self.labels = [[] for _ in programs]  # type: list[list[Action]]
        self.cursor = [0] * len(programs)
        self.done: set[tuple[int, Op, int, int]] = set()  # (rank, data key) made
        self.arrived: set[tuple[int, Op, int, int]] = set()  # (rank, receive key) in
        self.streams: dict[tuple[int, tuple[int, int]], deque[int]] = {}
        self.stream_of: list[tuple[int, tuple[int, int]]] = []  # per batch
        self.needs: list[list[tuple[int, Op, int, int]]] = []  # per batch: data of its sends
        self.messages: list[list[int]] = []  # per batch: its message numbers
        self.sender: dict[tuple[int, Op, int, int], int] = {}  # data -> batch sending it
        ends: dict[tuple[int, Action], int] = {}
        # per message: rank, action, batch, and its other end (peer rank, action)
        info: list[tuple[int, Action, int, tuple[int, Action]]] = []
        for p in programs:
            r = p.rank
            for step in p.steps:
                a = step.action
                if a.is_compute:
                    wait = None
                    if step.source == REMOTE:
                        wait = (r, Op.RECV_F if a.op is Op.F else Op.RECV_B, a.stage, a.microbatch)
                    made = (r, Op.SEND_F if a.op is Op.F else Op.SEND_B, a.stage, a.microbatch)
                    self.computes[r].append((wait, made))
                    self.labels[r].append(a)
                if step.batch is None:
                    continue
                b = len(self.messages)
                stream = (r, (-1, -1) if shared else step.batch.channel)
                self.streams.setdefault(stream, deque()).append(b)
                self.stream_of.append(stream)
                self.needs.append([])
                self.messages.append([])
                for m in step.batch.messages:
                    ends[(r, m.action)] = len(info)
                    self.messages[b].append(len(info))
                    info.append((r, m.action, b, (m.peer, _other_end(m))))
                    if m.is_send:
                        key = (r, *m.key)
                        self.needs[b].append(key)
                        self.sender[key] = b
        self.batch_of = [b for _, _, b, _ in info]
        self.partner = [ends.get(other, -1) for *_, other in info]
        self.info = info
        self.complete = [False] * len(info)
        self.work: deque[tuple[bool, object]] = deque(
            [(True, r) for r in range(len(programs))] + [(False, s) for s in self.streams]
        )

    def deadlock(self) -> str | None:
        while self.work:
            is_rank, item = self.work.popleft()
            if is_rank:
                self._compute(item)  # type: ignore[arg-type]
            else:
                self._communicate(item)  # type: ignore[arg-type]
        stuck = [
            f"rank {r} at {self.labels[r][self.cursor[r]]}"
            for r in range(len(self.computes))
            if self.cursor[r] < len(self.computes[r])
        ]
        stuck += [
            f"rank {s[0]} batch {' '.join(str(self.info[i][1]) for i in self.messages[q[0]])}"
            for s, q in self.streams.items()
            if q
        ]
        return "; ".join(stuck) or None

    def _compute(self, rank: int) -> None:
        steps, cursor = self.computes[rank], self.cursor[rank]
        while cursor < len(steps):
            wait, made = steps[cursor]
            if wait is not None and wait not in self.arrived:
                break
            self.done.add(made)
            b = self.sender.get(made)
            if b is not None:
                self.work.append((False, self.stream_of[b]))
            cursor += 1
        self.cursor[rank] = cursor

    def _head(self, stream: tuple[int, tuple[int, int]]) -> int:
        """The batch at the head of `stream` when it has started (its sends' data exists),
        else -1."""
        queue = self.streams.get(stream)
        if not queue:
            return -1
        b = queue[0]
        return b if all(key in self.done for key in self.needs[b]) else -1

    def _communicate(self, stream: tuple[int, tuple[int, int]]) -> None:
        """Complete the messages of `stream`'s started head batch whose other end sits in a
        started head batch; retire the batch once all completed."""
        while (b := self._head(stream)) >= 0:
            for i in self.messages[b]:
                j = self.partner[i]
                if self.complete[i] or j < 0:
                    continue
                other = self.batch_of[j]
                if self._head(self.stream_of[other]) == other:
                    self.complete[i] = self.complete[j] = True
                    self.work.append((False, self.stream_of[other]))
            if not all(self.complete[i] for i in self.messages[b]):
                return
            self.streams[stream].popleft()
            for i in self.messages[b]:
                rank, a, _, _ = self.info[i]
                if a.op not in _SENDS:
                    self.arrived.add((rank, a.op, a.stage, a.microbatch))
                    self.work.append((True, rank))


def _other_end(m: Message) -> Action:
    """The action at the other end of message `m`: its receive, or its send."""
    a = m.action
    kind = {Op.SEND_F: Op.RECV_F, Op.SEND_B: Op.RECV_B, Op.RECV_F: Op.SEND_F,
            Op.RECV_B: Op.SEND_B}[a.op]  # fmt: skip
    return Action(kind, m.peer_stage, a.microbatch)
