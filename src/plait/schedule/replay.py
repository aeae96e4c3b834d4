"""Abstract execution of a schedule: every rank runs its program in order, waiting on data.

This is the one interpreter of the IR's semantics outside the runtime. The validator runs
it with unit costs to prove a schedule cannot deadlock; the simulator runs it with
durations from the cost model. Semantics, shared with the runtime:

- a rank executes its actions strictly in program order, one compute action at a time;
- `F s,m` needs the activations of stage s-1 (local, or a posted `RECV_F s,m` whose
  message has arrived); `B`/`BI s,m` need `F s,m` and the output gradients of stage s+1
  (the loss on the last stage); `BW s,m` needs `BI s,m`;
- sends are asynchronous: a `SEND` starts when its data exists, occupies the directed
  channel to the peer (messages on one channel travel one after another) and never stalls
  the sender's compute;
- a `RECV` only posts a receive; the compute that consumes it waits for the arrival.

A schedule without any communication action is also accepted ("compute-only"): cross-rank
data then arrives `transfer` seconds after it is produced, as if sends and receives were
placed perfectly.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from plait.schedule.ir import COMM_OPS, Action, Op, Schedule

__all__ = ["Blocked", "Event", "Replay", "replay", "unit_duration"]

Duration = Callable[[int, Action], float]
Key = tuple[str, int, int]


def unit_duration(rank: int, action: Action) -> float:
    """Unit costs: forward 1, full backward 2, each half of a split backward 1, comms 0."""
    del rank
    return {Op.F: 1.0, Op.B: 2.0, Op.BI: 1.0, Op.BW: 1.0}.get(action.op, 0.0)


def _no_transfer(rank: int, action: Action) -> float:
    del rank, action
    return 0.0


@dataclass(frozen=True, slots=True)
class Event:
    """When one action ran. For a send, `end` is the arrival time at the peer."""

    rank: int
    index: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Blocked:
    """A rank that could not go on, the action it is stuck at, and what that action awaits."""

    rank: int
    index: int
    action: Action
    waiting_for: str


@dataclass(frozen=True)
class Replay:
    """The outcome of abstract execution."""

    events: tuple[tuple[Event, ...], ...]  # per rank, in program order (executed ones)
    blocked: tuple[Blocked, ...]  # empty when every program ran to its end
    peak_inflight: tuple[int, ...]  # per rank: most micro-batch activations held at once

    @property
    def completed(self) -> bool:
        return not self.blocked

    @property
    def makespan(self) -> float:
        ends = [e.end for program in self.events for e in program if e.action.op not in COMM_OPS]
        return max(ends, default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events[rank] if e.action.op not in COMM_OPS)


class _Machine:
    """State of one abstract execution; `run` drives it with a ready queue of ranks."""

    def __init__(self, schedule: Schedule, duration: Duration, transfer: Duration) -> None:
        self.s = schedule
        self.duration = duration
        self.transfer = transfer
        self.lowered = any(a.op in COMM_OPS for p in schedule.ranks for a in p)
        self.last = schedule.num_stages - 1
        self.pc = [0] * schedule.num_ranks
        self.clock = [0.0] * schedule.num_ranks
        self.events: list[list[Event]] = [[] for _ in range(schedule.num_ranks)]
        self.times: dict[Key, float] = {}  # facts that hold, and from when
        self.channel_free: dict[tuple[int, int], float] = defaultdict(float)
        self.waiters: dict[Key, list[int]] = defaultdict(list)
        self.inflight = [0] * schedule.num_ranks
        self.peak = [0] * schedule.num_ranks
        self.split: set[tuple[int, int]] = {
            (a.stage, a.microbatch) for p in schedule.ranks for a in p if a.op is Op.BI
        }

    def _remote_input(self, rank: int, kind: str, stage: int, mb: int) -> list[Key]:
        """Keys for data that stage `stage` on `rank` consumes from a neighbour stage."""
        src_stage = stage - 1 if kind == "F" else stage + 1
        produced: Key = ("F" if kind == "F" else "BI", src_stage, mb)
        if self.s.stage_to_rank[src_stage] == rank:
            return [produced]
        if not self.lowered:
            return [produced]
        return [("posted_" + kind, stage, mb), ("arrive_" + kind, stage, mb)]

    def _needs(self, rank: int, a: Action) -> list[Key]:
        s, m = a.stage, a.microbatch
        if a.op is Op.F:
            return [] if s == 0 else self._remote_input(rank, "F", s, m)
        if a.op in (Op.B, Op.BI):
            grads = [] if s == self.last else self._remote_input(rank, "B", s, m)
            return [("F", s, m), *grads]
        if a.op is Op.BW:
            return [("BI", s, m)]
        if a.op is Op.SEND_F:
            return [("F", s, m)]
        if a.op is Op.SEND_B:
            return [("BI", s, m)]
        return []  # receives only post

    def _ready_time(self, rank: int, a: Action, key: Key) -> float:
        t = self.times[key]
        if not self.lowered and key[0] in ("F", "BI") and key[1] != a.stage:
            src_rank = self.s.stage_to_rank[key[1]]
            if src_rank != rank:
                t += self.transfer(src_rank, Action(Op.SEND_F if key[0] == "F" else Op.SEND_B,
                                                    key[1], key[2]))
        return t

    def step(self, rank: int) -> Key | None:
        """Run `rank`'s next action if it can; return the key it waits for otherwise."""
        a = self.s.ranks[rank][self.pc[rank]]
        needs = self._needs(rank, a)
        for key in needs:
            if key not in self.times:
                return key
        ready = max((self._ready_time(rank, a, k) for k in needs), default=0.0)
        if a.op in COMM_OPS:
            self._communicate(rank, a, ready)
        else:
            start = max(self.clock[rank], ready)
            end = start + self.duration(rank, a)
            self.clock[rank] = end
            self._record(rank, a, start, end)
            self._account_memory(rank, a)
            self._publish(a, end)
        self.pc[rank] += 1
        return None

    def _communicate(self, rank: int, a: Action, ready: float) -> None:
        kind = "F" if a.op in (Op.SEND_F, Op.RECV_F) else "B"
        if a.op in (Op.RECV_F, Op.RECV_B):
            self._record(rank, a, self.clock[rank], self.clock[rank])
            self._set(("posted_" + kind, a.stage, a.microbatch), self.clock[rank])
            return
        dst_stage = a.stage + 1 if kind == "F" else a.stage - 1
        dst = self.s.stage_to_rank[dst_stage]
        start = max(ready, self.channel_free[(rank, dst)])
        end = start + self.transfer(rank, a)
        self.channel_free[(rank, dst)] = end
        self._record(rank, a, start, end)
        self._set(("arrive_" + kind, dst_stage, a.microbatch), end)

    def _account_memory(self, rank: int, a: Action) -> None:
        if a.op is Op.F:
            self.inflight[rank] += 1
            self.peak[rank] = max(self.peak[rank], self.inflight[rank])
        elif a.op is Op.BW or (a.op is Op.B and (a.stage, a.microbatch) not in self.split):
            self.inflight[rank] -= 1

    def _publish(self, a: Action, end: float) -> None:
        names = {Op.F: ("F",), Op.B: ("BI", "BW"), Op.BI: ("BI",), Op.BW: ("BW",)}[a.op]
        for name in names:
            self._set((name, a.stage, a.microbatch), end)

    def _set(self, key: Key, t: float) -> None:
        self.times[key] = t
        self.wake.extend(self.waiters.pop(key, ()))

    def _record(self, rank: int, a: Action, start: float, end: float) -> None:
        self.events[rank].append(Event(rank, self.pc[rank], a, start, end))

    def run(self) -> Replay:
        self.wake: deque[int] = deque(range(self.s.num_ranks))
        waiting: dict[int, Key] = {}
        while self.wake:
            rank = self.wake.popleft()
            waiting.pop(rank, None)
            program = self.s.ranks[rank]
            while self.pc[rank] < len(program):
                key = self.step(rank)
                if key is not None:
                    waiting[rank] = key
                    self.waiters[key].append(rank)
                    break
        blocked = tuple(
            Blocked(r, self.pc[r], self.s.ranks[r][self.pc[r]], _describe(k))
            for r, k in sorted(waiting.items())
        )
        return Replay(tuple(tuple(e) for e in self.events), blocked, tuple(self.peak))


def _describe(key: Key) -> str:
    what, stage, mb = key
    return {
        "F": f"forward {stage}F{mb}",
        "BI": f"input gradients of {stage}B{mb}",
        "posted_F": f"a posted receive {stage}RECV_F{mb}",
        "posted_B": f"a posted receive {stage}RECV_B{mb}",
        "arrive_F": f"the activations sent to stage {stage} for micro-batch {mb}",
        "arrive_B": f"the gradients sent to stage {stage} for micro-batch {mb}",
    }.get(what, f"{what}{stage},{mb}")


def replay(
    schedule: Schedule,
    *,
    duration: Duration = unit_duration,
    transfer: Duration = _no_transfer,
) -> Replay:
    """Execute `schedule` abstractly; `duration(rank, action)` gives compute times and
    `transfer(rank, send_action)` the time a message spends on its channel."""
    return _Machine(schedule, duration, transfer).run()
