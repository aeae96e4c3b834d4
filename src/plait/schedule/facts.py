"""What each action of a run needs before it starts and makes true when it ends, compiled.

The interpreters (`plait.schedule.replay`, and `plait.schedule.sharing` for time-shared
processors) number facts such as "3F7 has finished" as integers, and compile each
(rank, op, stage) once into a `Template` whose facts are offset by the micro-batch. The
rules are those of `plait.schedule.replay`'s module docstring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from plait.schedule.ir import COMM_OPS, Action, Op, Schedule

__all__ = [
    "COMPUTE",
    "FACT_KINDS",
    "RECV",
    "REDUCE",
    "SEND",
    "UNIT",
    "ByStage",
    "Compiler",
    "Template",
    "describe",
]

UNIT = {Op.F: 1.0, Op.B: 2.0, Op.BI: 1.0, Op.BW: 1.0}  # unit costs; every other action 0

# Fact kinds. A fact is the integer (kind * num_stages + stage) * width + microbatch; its
# entry in the times list is None until the fact holds, then the time from which it holds.
_F, _BI, _POSTED_F, _POSTED_B, _ARRIVE_F, _ARRIVE_B, _REDUCED = range(FACT_KINDS := 7)
COMPUTE, SEND, RECV, REDUCE = range(4)  # what the interpreter does with an action


class Template(NamedTuple):
    """One (rank, op, stage) compiled: fact numbers are bases, to which the micro-batch adds."""

    code: int  # COMPUTE, SEND, RECV or REDUCE
    needs: tuple[int, ...]  # facts that must hold before the action starts, in check order
    publish: int  # the fact that holds once it ends, or -1 (nothing waits on BW)
    channel: int  # sends: the directed channel (rank, peer); reductions: the rank's; else -1
    delta: int  # change of in-flight micro-batches on this rank
    # its unit duration (compute) or 0.0; where an interpreter's costs are fixed per (op,
    # stage) (`ByStage`), its duration (a send's: its transfer)
    unit: float
    # Compute-only schedules: the message a compute action sends once it ends, as
    # `add_communication` places a send right after it: (its directed channel, the fact its
    # arrival makes true, as a base, the send's op, its transfer where fixed); else None.
    send: tuple[int, int, Op, float | None] | None


class ByStage:
    """Durations that depend on an action's op and stage alone, as a table (`table[op][s]`):
    the simulator's costs. The interpreter reads each (rank, op, stage)'s once, where a
    callable would be called, and a send's action made, for every action of the run."""

    __slots__ = ("table",)

    def __init__(self, table: Mapping[Op, Sequence[float]]) -> None:
        self.table = table

    def __call__(self, rank: int, action: Action) -> float:
        del rank
        return self.table[action.op][action.stage]


class Compiler:
    """Turns (rank, op, stage) into `Template`s, following the module docstring."""

    def __init__(self, schedule: Schedule, lowered: bool) -> None:
        self.place, self.num_ranks = schedule.stage_to_rank, schedule.num_ranks
        self.num_stages, self.width = schedule.num_stages, schedule.num_microbatches
        _, self.after, self.before = schedule.graph
        self.lowered = lowered
        self.reduced = {a.stage for p in schedule.ranks for a in p if a.op is Op.REDUCE}

    def fact(self, kind: int, stage: int) -> int:
        return (kind * self.num_stages + stage) * self.width

    def template(self, rank: int, op: Op, stage: int) -> Template:
        if op in COMM_OPS:
            return self._comm(rank, op, stage)
        needs: tuple[int, ...] = ()
        before, after = self.before[stage], self.after[stage]
        if op is Op.F and before >= 0:
            needs = self._input(rank, stage, before, _F, _POSTED_F, _ARRIVE_F)
        elif op is Op.B or op is Op.BI:
            needs = (self.fact(_F, stage),)
            if after >= 0:
                needs += self._input(rank, stage, after, _BI, _POSTED_B, _ARRIVE_B)
        elif op is Op.BW:
            needs = (self.fact(_BI, stage),)
        elif op is Op.UPDATE and stage in self.reduced:
            needs = (self.fact(_REDUCED, stage),)
        publish = {Op.F: self.fact(_F, stage), Op.B: self.fact(_BI, stage)}.get(op, -1)
        if op is Op.BI:
            publish = self.fact(_BI, stage)
        delta = {Op.F: 1, Op.B: -1, Op.BW: -1}.get(op, 0)
        send = None
        if not self.lowered and op is not Op.BW:
            send = self._send(rank, op, stage)
        return Template(COMPUTE, needs, publish, -1, delta, UNIT.get(op, 0.0), send)

    def _input(
        self, rank: int, stage: int, src_stage: int, produced: int, posted: int, arrive: int
    ) -> tuple[int, ...]:
        """Facts for data `stage` on `rank` consumes from `src_stage`: its production on
        the same rank, else its arrival (and, lowered, the receive posted for it)."""
        if self.place[src_stage] == rank:
            return (self.fact(produced, src_stage),)
        if not self.lowered:
            return (self.fact(arrive, stage),)
        return (self.fact(posted, stage), self.fact(arrive, stage))

    def _send(self, rank: int, op: Op, stage: int) -> tuple[int, int, Op, float | None] | None:
        """Compute-only: what `op` of `stage` sends to another rank (`Template.send`)."""
        forward = op is Op.F
        if not forward and op is not Op.B and op is not Op.BI:
            return None
        dst_stage = self.after[stage] if forward else self.before[stage]
        if dst_stage < 0 or self.place[dst_stage] == rank:
            return None
        arrive = self.fact(_ARRIVE_F if forward else _ARRIVE_B, dst_stage)
        channel = rank * self.num_ranks + self.place[dst_stage]
        return channel, arrive, Op.SEND_F if forward else Op.SEND_B, None

    def _comm(self, rank: int, op: Op, stage: int) -> Template:
        if op is Op.RECV_F or op is Op.RECV_B:
            posted = self.fact(_POSTED_F if op is Op.RECV_F else _POSTED_B, stage)
            return Template(RECV, (), posted, -1, 0, 0.0, None)
        if op is Op.REDUCE:
            channel = self.num_ranks * self.num_ranks + rank
            return Template(REDUCE, (), self.fact(_REDUCED, stage), channel, 0, 0.0, None)
        forward = op is Op.SEND_F
        dst_stage = self.after[stage] if forward else self.before[stage]
        if dst_stage < 0:
            raise ValueError(
                f"{stage}{op.value} on rank {rank} sends past the end of its pipeline "
                f"(stage {stage} has no {'next' if forward else 'previous'} stage): remove it"
            )
        need = self.fact(_F if forward else _BI, stage)
        arrive = self.fact(_ARRIVE_F if forward else _ARRIVE_B, dst_stage)
        channel = rank * self.num_ranks + self.place[dst_stage]
        return Template(SEND, (need,), arrive, channel, 0, 0.0, None)

    def producer(self, fact: int) -> int:
        """Compute-only: the fact whose action sends the data that `fact`'s arrival brings
        (they hold together), else `fact` itself; what a rank waiting for it waits for."""
        if self.lowered:
            return fact
        rest, mb = divmod(fact, self.width)
        kind, stage = divmod(rest, self.num_stages)
        if kind == _ARRIVE_F:
            return self.fact(_F, self.before[stage]) + mb
        if kind == _ARRIVE_B:
            return self.fact(_BI, self.after[stage]) + mb
        return fact


def describe(fact: int, num_stages: int, width: int) -> str:
    """What fact number `fact` says, in words (what a blocked action waits for)."""
    rest, mb = divmod(fact, width)
    kind, stage = divmod(rest, num_stages)
    return {
        _F: f"forward {stage}F{mb}",
        _BI: f"input gradients of {stage}B{mb}",
        _POSTED_F: f"a posted receive {stage}RECV_F{mb}",
        _POSTED_B: f"a posted receive {stage}RECV_B{mb}",
        _ARRIVE_F: f"the activations sent to stage {stage} for micro-batch {mb}",
        _ARRIVE_B: f"the gradients sent to stage {stage} for micro-batch {mb}",
        _REDUCED: f"the gradient reduction {stage}REDUCE{mb}",
    }[kind]
