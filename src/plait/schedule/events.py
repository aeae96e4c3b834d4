"""What a replay returns: when each action ran (`Event`), the ranks that could not go on
(`Blocked`), the whole outcome (`Replay`), and its totals alone (`UnitSummary`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from typing import NamedTuple

from plait.schedule.ir import COMM_OPS, Action, Op

__all__ = ["Blocked", "Event", "Replay", "Sends", "UnitSummary", "new_event"]


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


class Sends(NamedTuple):
    """One rank's sends in a compute-only replay, in the order sent: each one's producer
    (its index in the program), start and arrival at the peer."""

    at: tuple[int, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]


@dataclass(frozen=True)
class Replay:
    """The outcome of abstract execution: per rank, the start and end of each executed
    action in program order (`starts`, `ends`; the actions are `programs[r][:len(starts[r])]`),
    and the same as `Event`s, built on first use (a planner reads the times alone, and a
    large replay has hundreds of thousands of actions)."""

    programs: tuple[tuple[Action, ...], ...]
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    blocked: tuple[Blocked, ...]  # empty when every program ran to its end
    peak_inflight: tuple[int, ...]  # per rank: most micro-batch activations held at once
    # a compute-only replay's sends, per rank in the order sent; empty for a lowered
    # schedule, whose sends are in its programs
    sends: tuple[Sends, ...] = ()

    @cached_property
    def events(self) -> tuple[tuple[Event, ...], ...]:
        """Per rank, in program order (executed ones); a compute-only replay's sends each
        right after its producer, with the producer's index (where lowering puts them)."""
        plain = tuple(
            tuple(map(new_event, repeat(rank), range(len(starts)), program, starts, ends))
            for rank, (program, starts, ends) in enumerate(
                zip(self.programs, self.starts, self.ends, strict=True)
            )
        )
        if not self.sends:
            return plain
        return tuple(_with_sends(*args) for args in zip(plain, self.sends, strict=True))

    @property
    def completed(self) -> bool:
        return not self.blocked

    @property
    def makespan(self) -> float:
        ends = [e.end for program in self.events for e in program if e.action.op not in COMM_OPS]
        return max(ends, default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events[rank] if e.action.op not in COMM_OPS)


def _with_sends(events: tuple[Event, ...], sends: Sends) -> tuple[Event, ...]:
    """`events` with each send after its producer, as the lowered program has it."""
    out: list[Event] = []
    at = 0
    for e in events:
        out.append(e)
        while at < len(sends.at) and sends.at[at] == e.index:
            index, start, end = sends.at[at], sends.starts[at], sends.ends[at]
            op = Op.SEND_F if e.action.op is Op.F else Op.SEND_B
            action = Action(op, e.action.stage, e.action.microbatch)
            out.append(new_event(e.rank, index, action, start, end))
            at += 1
    return tuple(out)


def new_event(rank: int, index: int, action: Action, start: float, end: float) -> Event:
    """`Event(...)` at half the cost: sets the slots through their descriptors, as the
    generated __init__ of a frozen dataclass does through object.__setattr__ (a large replay
    creates 200 000 events)."""
    event = _new_event(Event)
    _set_rank(event, rank)
    _set_index(event, index)
    _set_action(event, action)
    _set_start(event, start)
    _set_end(event, end)
    return event


_new_event = object.__new__
_set_rank, _set_index, _set_action, _set_start, _set_end = (
    getattr(Event, name).__set__ for name in ("rank", "index", "action", "start", "end")
)


@dataclass(frozen=True)
class UnitSummary:
    """What the validator needs from a unit-cost replay, without building its events."""

    completed: bool
    peak_inflight: tuple[int, ...]
    makespan: float  # equals Replay.makespan
    busy: tuple[float, ...]  # per rank, equals Replay.busy(rank)
