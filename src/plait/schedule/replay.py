"""Abstract execution of a schedule: every rank runs its program in order, waiting on data.

This is the one interpreter of the IR's semantics outside the runtime. The validator runs
it with unit costs to prove a schedule cannot deadlock; the simulator runs it with
durations from the cost model. Semantics, shared with the runtime:

- a rank executes its actions strictly in program order, one compute action at a time;
- `F s,m` needs the activations of the stage before s in the stage graph (local, or a
  posted `RECV_F s,m` whose message has arrived); `B`/`BI s,m` need `F s,m` and the
  output gradients of the stage after s (the loss on a last stage); `BW s,m` needs
  `BI s,m`;
- sends are asynchronous: a `SEND` starts when its data exists (however late it sits in the
  program), occupies the directed channel to the peer (messages on one channel travel one
  after another, in the sender's program order) and never stalls the sender's compute;
- a `RECV` only posts a receive; the compute that consumes it waits for the arrival;
- a `REDUCE` starts when the rank reaches it, occupies the rank's data-parallel channel
  (one reduction after another) and never stalls compute; the `UPDATE` of the same stage
  and micro-batch waits for it to end. `UPDATE`, `STASH`, `PREDICT` and `FREE` take the
  rank like compute (for their `duration`; 0 under unit costs).

A schedule is replayed as the run of `windows` windows its stream makes
(`plait.schedule.stream.unroll`); a synchronous schedule's one window is itself.

A schedule without any communication action is also accepted ("compute-only"): each
compute action that produces another rank's data then sends it as soon as it ends, as
`plait.schedule.passes.add_communication` places a send right after its producer (on the
same directed channels, in the same order), so every action takes the times it takes in
the lowered schedule. Receives only post, so they change no time; what a compute-only
replay lacks is their events, and its sends are kept beside the programs
(`Replay.sends`). A planner replays the compute-only form of the schedules it prices: less
than half the actions, and no lowering.

Time-shared processors (`sharing`) are a policy of the same interpreter: one global
clock instead of a clock per rank, and compute actions that finish as
`plait.schedule.sharing.SharedProcessors` says; everything else is unchanged.

Peak in-flight counts, per rank, the micro-batches whose activations are held: a forward
adds one, and the backward that frees them (`BW`, or a full `B`) removes it.

Written for speed (64 ranks × 512 micro-batches replay in a fraction of a second): facts
such as "3F7 has finished" are integers indexing one list of times, and each (rank, op,
stage) is compiled once into a `Template` whose facts are offset by the micro-batch.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from operator import attrgetter

from plait.schedule.events import Blocked, Event, Replay, Sends, UnitSummary
from plait.schedule.facts import (
    COMPUTE,
    FACT_KINDS,
    REDUCE,
    SEND,
    UNIT,
    ByStage,
    Compiler,
    Template,
    describe,
)
from plait.schedule.ir import P2P_OPS, Action, Op, Schedule
from plait.schedule.pause import gc_paused
from plait.schedule.sharing import SharedProcessors, Sharing
from plait.schedule.stream import unroll

__all__ = ["Blocked", "Event", "Replay", "UnitSummary", "replay", "unit_duration", "unit_summary"]

Duration = Callable[[int, Action], float]
_EPS, _INF = 1e-12, float("inf")


def unit_duration(rank: int, action: Action) -> float:
    """Unit costs: forward 1, full backward 2, each half of a split backward 1, comms 0."""
    del rank
    return UNIT.get(action.op, 0.0)


def _no_transfer(rank: int, action: Action) -> float:
    del rank, action
    return 0.0


def _check_ranges(schedule: Schedule) -> None:
    """Reject indices the fact numbering cannot hold (validate() names the action)."""
    for rank, program in enumerate(schedule.ranks):
        if program and (
            max(map(attrgetter("stage"), program)) >= schedule.num_stages
            or max(map(attrgetter("microbatch"), program)) >= schedule.num_microbatches
        ):
            raise ValueError(
                f"rank {rank} has an action outside stages 0..{schedule.num_stages - 1} or "
                f"micro-batches 0..{schedule.num_microbatches - 1}: fix the generator, or "
                "call validate() to see which action"
            )


# per schedule (by identity, the schedule kept alive beside them): what a replay derives
# from its programs alone; a planner replays each schedule it builds several times
_PREPARED: dict[int, tuple[Schedule, set[tuple[int, int]], Compiler]] = {}
_KEPT = 8  # as many as `plait.sim.build_schedule` keeps


def _prepared(schedule: Schedule) -> tuple[set[tuple[int, int]], Compiler]:
    """(the (stage, micro-batch) pairs whose backward is split, the template compiler) of
    `schedule`, its ranges checked; kept for the last few schedules."""
    kept = _PREPARED.get(id(schedule))
    if kept is not None and kept[0] is schedule:
        return kept[1], kept[2]
    _check_ranges(schedule)
    lowered = any(a.op in P2P_OPS for p in schedule.ranks for a in p)
    bi = Op.BI  # looking members up on an Enum class is slow
    split = {(a.stage, a.microbatch) for p in schedule.ranks for a in p if a.op is bi}
    if len(_PREPARED) >= _KEPT:
        _PREPARED.clear()
    _PREPARED[id(schedule)] = (schedule, split, Compiler(schedule, lowered))
    return split, _PREPARED[id(schedule)][2]


class _Machine:
    """State of one abstract execution; `execute` drives it with a ready queue of ranks."""

    def __init__(
        self,
        schedule: Schedule,
        duration: Duration,
        transfer: Duration,
        sharing: Sharing | None = None,
    ) -> None:
        self.s = schedule
        self.duration = duration
        self.transfer = transfer
        self.split, self.compiler = _prepared(schedule)
        p, num_stages = schedule.num_ranks, schedule.num_stages
        # templates[rank][stage][op]: a list and a dict, cheaper than a dict keyed by tuples
        self.templates: list[list[dict[Op, Template]]] = [
            [{} for _ in range(num_stages)] for _ in range(p)
        ]
        self.pc = [0] * p
        self.clock = [0.0] * p
        self.starts: list[list[float]] = [[] for _ in range(p)]
        self.ends: list[list[float]] = [[] for _ in range(p)]
        size = FACT_KINDS * num_stages * schedule.num_microbatches
        self.times: list[float | None] = [None] * size
        self.channel_free = [0.0] * (p * p + p)  # directed channels, then reductions
        self.waiters: dict[int, list[int]] = {}
        self.waiting: dict[int, int] = {}
        self.inflight = [0] * p
        self.peak = [0] * p
        self.busy = [0.0] * p  # compute time per rank
        # compute-only: per rank, (index of the producer, start, end) of each send
        self.sent: list[tuple[list[int], list[float], list[float]]] = [
            ([], [], []) for _ in range(p)
        ]
        self.wake: deque[int] = deque(range(p))
        # time-shared processors: one global clock, compute finishing as `shared` says
        self.shared = SharedProcessors(sharing, p) if sharing is not None else None
        self.now = 0.0
        self.timers: list[tuple[float, int]] = []  # (when, rank): its data lands then

    def _template(self, rank: int, a: Action) -> Template:
        t = self._priced(self.compiler.template(rank, a.op, a.stage), a)
        if a.op is Op.B and self.split:
            # A full B frees no activations when a BI split the same (stage, micro-batch);
            # such a template depends on the micro-batch, so it is not cached.
            return t._replace(delta=0) if (a.stage, a.microbatch) in self.split else t
        self.templates[rank][a.stage][a.op] = t
        return t

    def _priced(self, t: Template, a: Action) -> Template:
        """`t` with the durations a `ByStage` table fixes: its own in `unit`, its send's."""
        durations = self.duration.table if isinstance(self.duration, ByStage) else None
        moves = self.transfer.table if isinstance(self.transfer, ByStage) else None
        if durations is not None and t.code in (COMPUTE, REDUCE):
            t = t._replace(unit=durations[a.op][a.stage])
        if moves is not None and t.code == SEND:
            t = t._replace(unit=moves[a.op][a.stage])
        if moves is not None and t.send is not None:
            channel, arrive, op, _ = t.send
            t = t._replace(send=(channel, arrive, op, moves[op][a.stage]))
        return t

    def run_rank(self, rank: int) -> None:
        """Run `rank` until its program ends or it waits for a fact: the hot loop.

        One long function on purpose: the per-action work is inlined and the state read into
        locals, which is what makes a 200 000-action replay take a fraction of a second.
        """
        program = self.s.ranks[rank]
        pc, clock = self.pc[rank], self.clock[rank]
        inflight, peak, busy = self.inflight[rank], self.peak[rank], self.busy[rank]
        times, waiters, wake, by_stage = self.times, self.waiters, self.wake, self.templates[rank]
        starts, ends, channel_free = self.starts[rank], self.ends[rank], self.channel_free
        sent_at, sent_start, sent_end = self.sent[rank]
        # durations fixed per (op, stage) are each template's `unit`
        unit = self.duration is unit_duration or isinstance(self.duration, ByStage)
        no_transfer = self.transfer is _no_transfer
        fixed_transfer = isinstance(self.transfer, ByStage)
        shared = self.shared
        n = len(program)
        try:
            while pc < n:
                a = program[pc]
                m = a.microbatch
                t = by_stage[a.stage].get(a.op) or self._template(rank, a)
                code, needs, publish, channel, delta, unit_cost, send = t
                ready = 0.0
                for base in needs:
                    when = times[base + m]
                    if when is None:
                        self.waiting[rank] = base + m
                        waiters.setdefault(base + m, []).append(rank)
                        return
                    if when > ready:
                        ready = when
                if shared is not None:  # one clock: wait for the data, share the processor
                    if ready > self.now + _EPS:
                        heapq.heappush(self.timers, (ready, rank))
                        return
                    if code == COMPUTE:
                        shared.start(rank, unit_cost if unit else self.duration(rank, a), clock)
                        return
                if code == COMPUTE:
                    start = clock if clock > ready else ready
                    end = clock = start + (unit_cost if unit else self.duration(rank, a))
                    busy += end - start
                    if delta:
                        inflight += delta
                        if inflight > peak:
                            peak = inflight
                elif code == SEND:
                    free = channel_free[channel]
                    start = ready if ready > free else free
                    if no_transfer:
                        end = start
                    else:
                        end = start + (unit_cost if fixed_transfer else self.transfer(rank, a))
                    channel_free[channel] = end
                elif code == REDUCE:
                    free = channel_free[channel]
                    start = clock if clock > free else free
                    end = start + (unit_cost if unit else self.duration(rank, a))
                    channel_free[channel] = end
                else:
                    start = end = clock
                if publish >= 0:
                    times[publish + m] = end
                    if publish + m in waiters:
                        wake.extend(waiters.pop(publish + m))
                if send is not None:  # compute-only: its send, as if placed right after it
                    free = channel_free[send[0]]
                    sent = end if end > free else free
                    if no_transfer:
                        arrival = sent
                    elif send[3] is not None:
                        arrival = sent + send[3]
                    else:
                        arrival = sent + self.transfer(rank, Action(send[2], a.stage, m))
                    channel_free[send[0]] = arrival
                    times[send[1] + m] = arrival
                    if send[1] + m in waiters:
                        wake.extend(waiters.pop(send[1] + m))
                    sent_at.append(pc)
                    sent_start.append(sent)
                    sent_end.append(arrival)
                starts.append(start)
                ends.append(end)
                pc += 1
        finally:
            self.pc[rank], self.clock[rank] = pc, clock
            self.inflight[rank], self.peak[rank], self.busy[rank] = inflight, peak, busy

    def execute(self) -> None:
        if self.shared is not None:
            self._execute_shared(self.shared)
            return
        while self.wake:
            rank = self.wake.popleft()
            self.waiting.pop(rank, None)
            self.run_rank(rank)

    def _execute_shared(self, shared: SharedProcessors) -> None:
        """Advance one global clock: run every rank that can go on at `now`, then move to
        the next moment a compute action finishes or data lands."""
        while True:
            while self.wake:
                rank = self.wake.popleft()
                self.waiting.pop(rank, None)
                self.clock[rank] = max(self.clock[rank], self.now)
                self.run_rank(rank)
            if not shared.running and not self.timers:
                return
            until = min(shared.next_finish(self.now), self.timers[0][0] if self.timers else _INF)
            for rank, start in shared.advance(self.now, until):
                self._finish(rank, start, until)
                self.wake.append(rank)
            self.now = until
            while self.timers and self.timers[0][0] <= until + _EPS:
                self.wake.append(heapq.heappop(self.timers)[1])

    def _finish(self, rank: int, start: float, end: float) -> None:
        """A time-shared compute action of `rank` ran from `start` to `end`."""
        a = self.s.ranks[rank][self.pc[rank]]
        t = self.templates[rank][a.stage].get(a.op) or self._template(rank, a)
        self.busy[rank] += end - start
        self.inflight[rank] += t.delta
        self.peak[rank] = max(self.peak[rank], self.inflight[rank])
        if t.publish >= 0:
            fact = t.publish + a.microbatch
            self.times[fact] = end
            self.wake.extend(self.waiters.pop(fact, ()))
        if t.send is not None:  # as `run_rank` sends
            channel, arrive, op, cost = t.send
            sent = max(end, self.channel_free[channel])
            if cost is None:
                cost = self.transfer(rank, Action(op, a.stage, a.microbatch))
            arrival = sent + cost
            self.channel_free[channel] = arrival
            self.times[arrive + a.microbatch] = arrival
            self.wake.extend(self.waiters.pop(arrive + a.microbatch, ()))
            at, starts, ends = self.sent[rank]
            at.append(self.pc[rank])
            starts.append(sent)
            ends.append(arrival)
        self.starts[rank].append(start)
        self.ends[rank].append(end)
        self.pc[rank] += 1
        self.clock[rank] = end

    def result(self) -> Replay:
        describe = self._describe
        waits = sorted(self.waiting.items())
        blocked = tuple(
            Blocked(r, self.pc[r], self.s.ranks[r][self.pc[r]], describe(self.compiler.producer(f)))
            for r, f in waits
        )
        return Replay(
            self.s.ranks,
            tuple(map(tuple, self.starts)),
            tuple(map(tuple, self.ends)),
            blocked,
            tuple(self.peak),
            () if self.compiler.lowered else tuple(_sends(*x) for x in self.sent),
        )

    def _describe(self, fact: int) -> str:
        return describe(fact, self.s.num_stages, self.s.num_microbatches)


def _sends(at: list[int], starts: list[float], ends: list[float]) -> Sends:
    return Sends(tuple(at), tuple(starts), tuple(ends))


def replay(
    schedule: Schedule,
    *,
    duration: Duration = unit_duration,
    transfer: Duration = _no_transfer,
    windows: int = 1,
    sharing: Sharing | None = None,
) -> Replay:
    """Execute `windows` windows of `schedule` abstractly; `duration(rank, action)` gives
    the times of compute actions, updates, weight copies and reductions, and
    `transfer(rank, send_action)` the time a message spends on its channel. With
    `sharing` (`plait.schedule.sharing`), ranks time-share processors: a compute action's
    `duration` is its work on a processor of its own, done at the speed its processor's
    load leaves it (one global clock)."""
    if sharing is not None and len(sharing.processor) != schedule.num_ranks:
        raise ValueError(
            f"sharing names {len(sharing.processor)} ranks for a schedule of "
            f"{schedule.num_ranks}: give one processor per rank"
        )
    with gc_paused():
        machine = _Machine(unroll(schedule, windows).schedule, duration, transfer, sharing)
        machine.execute()
        return machine.result()


def unit_summary(schedule: Schedule) -> UnitSummary:
    """`replay(schedule)` of a whole run (an unrolled schedule) reduced to its totals: half
    the time, as no event is created."""
    with gc_paused():
        machine = _Machine(schedule, unit_duration, _no_transfer)
        machine.execute()
    return UnitSummary(
        completed=not machine.waiting,
        peak_inflight=tuple(machine.peak),
        makespan=max(machine.clock, default=0.0),
        busy=tuple(machine.busy),
    )
