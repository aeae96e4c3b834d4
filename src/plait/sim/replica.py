"""Replay any schedule on the cost model: durations, transfers, gradient sync, optimizer.

Every action's time comes from the cost model, never from the schedule's kind: a compute
action costs its stage's FLOPs on the rank's device (`StageCost.times`, recomputation and
tensor-parallel collectives included), a send costs latency + bytes/bandwidth on the link
between the two ranks, and `plait.schedule.replay` does the rest (program order, data
dependencies, one message at a time per channel). After the pipeline, each stage's
gradients are reduced over its data-parallel group as soon as its last backward ends (on
one communication channel per rank, overlapping later backwards, as DDP's bucketed
reduction does at stage granularity), then the rank runs its optimizer step.

Limits: one data-parallel replica is replayed per distinct hardware signature (replicas
on identical devices and links behave identically); ZeRO-3 gathers a stage's weights
before each forward and backward without prefetching (pessimistic); tied embeddings'
extra all-reduce and gradient clipping's norm are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from plait.cluster import Cluster, Device, Link, dtype_bytes
from plait.cost import (
    BlockCost,
    Collective,
    StageCost,
    collective_time,
    dp_sync_time,
    model_state_bytes,
    optimizer_step_time,
)
from plait.schedule import Action, Op, Replay, Schedule, replay
from plait.schedule.sharing import Sharing, replay_shared, share_jobs
from plait.sim.plan import SimPlan
from plait.sim.result import MemoryUse, RankReport, TimelineEvent

__all__ = ["ReplicaRun", "signature", "simulate_replica"]


@dataclass
class _Walk:
    """What one pass over a rank's events learns."""

    busy: float = 0.0
    compute_end: float = 0.0
    activation_peak: float = 0.0
    p2p: float = 0.0


@dataclass(frozen=True)
class ReplicaRun:
    """One data-parallel replica's simulated step."""

    replay: Replay
    ranks: tuple[RankReport, ...]
    extra_events: tuple[TimelineEvent, ...]
    pipeline_time_s: float
    busy_s: float

    @property
    def step_time_s(self) -> float:
        return max(r.end_s for r in self.ranks)


class _Replica:
    """Costs of one data-parallel replica, precomputed per stage so that replay's
    callbacks are table lookups."""

    def __init__(
        self,
        schedule: Schedule,
        stages: Sequence[StageCost],
        cluster: Cluster,
        plan: SimPlan,
        dp_rank: int,
    ) -> None:
        self.s, self.stages, self.cluster, self.plan = schedule, stages, cluster, plan
        self.ranks = [plan.global_rank(r, dp_rank) for r in range(plan.pp)]
        self.devices = [cluster.device(g) for g in self.ranks]
        self.dp_links = [cluster.group_link(plan.dp_group(r)) for r in range(plan.pp)]
        place = schedule.stage_to_rank
        self.times = [
            st.times(
                self.devices[place[i]],
                plan.dtype,
                recompute=plan.recompute,
                tp=plan.tp,
                tp_link=cluster.group_link(plan.tp_group(place[i], dp_rank)),
            )
            for i, st in enumerate(stages)
        ]
        self.gather = [self._zero3_gather(i) for i in range(len(stages))]
        self.durations = self._durations()
        self.transfers = self._transfers()
        self.sharing = _sharing(cluster, plan, dp_rank) if cluster.shares_processors else None

    def _param_bytes(self, stage: int) -> float:
        return self.stages[stage].num_params * dtype_bytes(self.plan.dtype)

    def _zero3_gather(self, stage: int) -> float:
        if self.plan.zero_stage < 3 or self.plan.dp == 1:
            return 0.0
        gather = Collective(kind="all_gather", num_bytes=self._param_bytes(stage))
        link = self.dp_links[self.s.stage_to_rank[stage]]
        return collective_time(gather, self.plan.dp, link)

    def _durations(self) -> dict[Op, list[float]]:
        t, g = self.times, self.gather
        return {
            Op.F: [x.forward_s + y for x, y in zip(t, g, strict=True)],
            Op.B: [x.backward_s + y for x, y in zip(t, g, strict=True)],
            Op.BI: [x.backward_input_s + y for x, y in zip(t, g, strict=True)],
            Op.BW: [x.backward_weight_s for x in t],
        }

    def _transfers(self) -> dict[Op, list[float]]:
        place, n = self.s.stage_to_rank, len(self.stages)
        forward, backward = [0.0] * n, [0.0] * n
        for i in range(n - 1):
            link = self.cluster.link(self.ranks[place[i]], self.ranks[place[i + 1]])
            forward[i] = backward[i + 1] = link.time(self.stages[i].activation_bytes)
        return {Op.SEND_F: forward, Op.SEND_B: backward}

    def dp_sync_time(self, stage: int) -> float:
        """Gradient reduction of one stage over its data-parallel group (`dp_sync_time`)."""
        link = self.dp_links[self.s.stage_to_rank[stage]]
        return dp_sync_time(
            self._param_bytes(stage), zero_stage=self.plan.zero_stage, dp=self.plan.dp, link=link
        )

    def run(self) -> ReplicaRun:
        durations, transfers = self.durations, self.transfers

        def duration(rank: int, action: Action) -> float:
            return durations[action.op][action.stage]

        def transfer(rank: int, action: Action) -> float:
            return transfers[action.op][action.stage]

        if self.sharing is None:
            result = replay(self.s, duration=duration, transfer=transfer)
        else:
            result = replay_shared(self.s, self.sharing, duration=duration, transfer=transfer)
        if not result.completed:
            stuck = "; ".join(f"rank {b.rank} at {b.action}" for b in result.blocked)
            raise ValueError(
                f"schedule {self.s.kind} deadlocks under the cost model: {stuck}; "
                "validate it with plait.schedule.validate"
            )
        reports, extra, busy, span = [], [], 0.0, 0.0
        for rank in range(self.plan.pp):
            report, events, walk = self._rank(rank, result)
            reports.append(report)
            extra += events
            busy += walk.busy
            span = max(span, walk.compute_end)
        if self.sharing is not None:
            reports, extra = _shared_optimizer(self.sharing, reports, extra)
        return ReplicaRun(result, tuple(reports), tuple(extra), span, busy)

    def _walk(self, rank: int, result: Replay, last_backward: dict[int, float]) -> _Walk:
        """One pass over the rank's events: busy time, activation peak, send time. A hot
        loop (200 000 events for 64 × 512), hence the locals."""
        saved = [st.saved_bytes(self.plan.recompute) for st in self.stages]
        busy = p2p = held = peak = end = 0.0
        f, b, bi, bw = Op.F, Op.B, Op.BI, Op.BW
        for e in result.events[rank]:
            action = e.action
            op = action.op
            if op is f:
                held += saved[action.stage]
                if held > peak:
                    peak = held
            elif op is b or op is bw:
                held -= saved[action.stage]
                last_backward[action.stage] = e.end
            elif op is not bi:
                p2p += e.end - e.start
                continue
            end = e.end
            busy += end - e.start
        return _Walk(busy=busy, compute_end=end, activation_peak=peak, p2p=p2p)

    def _rank(self, rank: int, result: Replay) -> tuple[RankReport, list[TimelineEvent], _Walk]:
        last_backward: dict[int, float] = {}
        walk = self._walk(rank, result, last_backward)
        events, channel = [], 0.0
        for stage in sorted(last_backward, key=last_backward.__getitem__):
            sync = self.dp_sync_time(stage)
            if sync > 0:
                start = max(channel, last_backward[stage])
                channel = start + sync
                events.append(TimelineEvent(rank, f"{stage}DP", start, channel, "comm"))
        mine = self.s.stages_of(rank)
        params = sum(self.stages[i].num_params for i in mine)
        device, plan = self.devices[rank], self.plan
        optimizer = optimizer_step_time(
            params,
            device,
            dtype=plan.dtype,
            zero_stage=plan.zero_stage,
            dp=plan.dp,
            optimizer=plan.optimizer,
        )
        start = max(walk.compute_end, channel)
        events.append(TimelineEvent(rank, "OPT", start, start + optimizer, "optimizer"))
        m = self.s.num_microbatches
        tp_comm = m * sum(
            self.times[i].comm_forward_s + self.times[i].comm_backward_s + 2 * self.gather[i]
            for i in mine
        )
        report = RankReport(
            pp_rank=rank,
            global_rank=self.ranks[rank],
            device=device.name,
            compute_s=walk.busy - tp_comm,
            tp_comm_s=tp_comm,
            p2p_s=walk.p2p,
            dp_comm_s=sum(self.dp_sync_time(i) for i in mine),
            optimizer_s=optimizer,
            end_s=start + optimizer,
            memory=self._memory(rank, mine, walk.activation_peak),
            capacity_bytes=float(device.memory_bytes),
        )
        return report, events, walk

    def _memory(self, rank: int, mine: list[int], activations: float) -> MemoryUse:
        plan = self.plan
        params = sum(self.stages[i].num_params for i in mine)
        state = model_state_bytes(
            params,
            dtype=plan.dtype,
            zero_stage=plan.zero_stage,
            dp=plan.dp,
            optimizer=plan.optimizer,
        )
        transient = max(self.stages[i].transient_bytes(plan.recompute) for i in mine)
        if plan.zero_stage == 3 and plan.dp > 1:
            transient += max(self._param_bytes(i) for i in mine)
        return MemoryUse(
            params=state.params,
            grads=state.grads,
            optimizer=state.optimizer,
            activations=activations,
            transient=transient,
        )


def _shared_optimizer(
    sharing: Sharing, reports: list[RankReport], extra: list[TimelineEvent]
) -> tuple[list[RankReport], list[TimelineEvent]]:
    """The optimizer steps again, with ranks that share a processor sharing it."""
    steps = {e.rank: e for e in extra if e.label == "OPT"}
    ready = [steps[r.pp_rank].start for r in reports]
    ends = share_jobs(sharing, ready, [r.optimizer_s for r in reports])
    extra = [e for e in extra if e.label != "OPT"]
    extra += [TimelineEvent(r, "OPT", ready[r], ends[r], "optimizer") for r in steps]
    return [replace(r, end_s=ends[r.pp_rank]) for r in reports], extra


def _sharing(cluster: Cluster, plan: SimPlan, dp_rank: int) -> Sharing:
    """Processors of the replica's ranks, each loaded by every process that computes in
    step with a replica rank: that rank's copies in every replica and its tensor peers
    (replicas are assumed to run alike, which they do on identical devices)."""
    processors = [cluster.processor(plan.global_rank(r, dp_rank)) for r in range(plan.pp)]
    ids = sorted(set(processors))
    load = [[0] * plan.pp for _ in ids]
    for r in range(plan.pp):
        for d in range(plan.dp):
            for t in range(plan.tp):
                p = cluster.processor(plan.global_rank(r, d, t))
                if p in ids:
                    load[ids.index(p)][r] += 1
    ranks = [plan.global_rank(r, dp_rank) for r in range(plan.pp)]
    efficiency = min(cluster.sharing_efficiency(g) for g in ranks)
    return Sharing(tuple(ids.index(p) for p in processors), tuple(map(tuple, load)), efficiency)


def signature(cluster: Cluster, plan: SimPlan, dp_rank: int) -> tuple[object, ...]:
    """What determines a replica's timing: its devices and the links it uses."""
    ranks = [plan.global_rank(r, dp_rank) for r in range(plan.pp)]
    devices: list[Device] = [cluster.device(g) for g in ranks]
    links: list[Link] = [cluster.group_link(plan.tp_group(r, dp_rank)) for r in range(plan.pp)]
    links += [cluster.link(ranks[r], ranks[(r + 1) % plan.pp]) for r in range(plan.pp)]
    shared = _sharing(cluster, plan, dp_rank) if cluster.shares_processors else None
    return (*devices, *links, shared)


def simulate_replica(
    schedule: Schedule,
    stages: Sequence[StageCost | BlockCost],
    cluster: Cluster,
    plan: SimPlan,
    dp_rank: int = 0,
) -> ReplicaRun:
    """Replay one data-parallel replica of `plan` (`plait.sim.simulate` runs them all)."""
    stage_list = [StageCost.of(s) for s in stages]
    return _Replica(schedule, stage_list, cluster, plan, dp_rank).run()
