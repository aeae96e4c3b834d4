"""Replay any schedule on the cost model: durations, transfers, reductions, updates, copies.

Every action's time comes from the cost model, never from the schedule's kind: a compute
action costs its stage's FLOPs on the rank's device (`StageCost.times`, recomputation and
tensor-parallel collectives included), a send costs latency + bytes/bandwidth on the link
between the two ranks, a `REDUCE` the stage's gradient reduction over its data-parallel
group (on the rank's reduction channel, overlapping whatever follows, as DDP's bucketed
reduction does at stage granularity; expert gradients over their expert-data-parallel
group of dp·tp / ep ranks, after the others; under context parallelism over dp × cp), an
`UPDATE` the stage's optimizer step (after its replicas' gradients are summed, Chimera), a weight
copy (`STASH`, `PREDICT`) a pass over the stage's parameters at memory bandwidth;
`plait.schedule.replay` does the rest (program order, data dependencies, one message at a
time per channel). A synchronous schedule is replayed as one window; an asynchronous one
as a run long enough to reach its steady state, whose window period is the step time.

Memory per rank is the model state, the activations of the micro-batches in flight at the
peak, the weight copies alive at their peak (asynchronous schedules: see
`plait.schedule.asynchronous` for each kind's count), and the transient working set.
Offload (`plait.cost.memory`) takes the chosen blocks' saved activations off the device,
leaving one block's, and adds their host-link crossings to its forward and backward; an
offloaded optimizer state is charged to the device only beyond the step-free working set,
and its two crossings to the update.

Limits: one data-parallel replica is replayed per distinct hardware signature (replicas
on identical devices and links behave identically); ZeRO-3 gathers a stage's weights
before each forward and backward without prefetching (pessimistic); tied embeddings'
extra all-reduce and gradient clipping's norm are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from plait.cluster import Cluster, Device, Link, dtype_bytes
from plait.cost import (
    AxisLinks,
    BlockCost,
    ModelState,
    StageCost,
    all_reduce_time,
    expert_state_bytes,
    moe_optimizer_step_time,
    offload_time,
    stage_sync_time,
    swapped_optimizer_bytes,
    sync_degrees,
    weight_gather_time,
)
from plait.offload import offloaded_blocks
from plait.schedule import Op, Replay, Schedule, Unrolled, window_ends
from plait.sim.cores import replica_sharing
from plait.sim.host import host_window_s, issue_times, posting_times
from plait.sim.plan import SimPlan
from plait.sim.replays import replayed, walked
from plait.sim.result import MemoryUse, RankReport
from plait.sim.walk import Walk, walk, walk_events

__all__ = ["ReplicaRun", "signature", "simulate_replica"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class ReplicaRun:
    """One data-parallel replica's simulated run; times are per window (per step)."""

    replay: Replay
    ranks: tuple[RankReport, ...]
    pipeline_time_s: float  # the pipelined compute of one window (steady state)
    # work of one window summed over the ranks: forward and backward; for an asynchronous
    # schedule also the updates and weight copies interleaved with them
    busy_s: float
    step_time_s: float


# the event-by-event read of each rank's times (`plait.sim.walk.walk_events`), for tests
REFERENCE_WALK = False


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
        # per pipeline rank: the groups its collectives, gradient reductions included, run over
        self.axes = [_axis_links(cluster, plan, r, dp_rank) for r in range(plan.pp)]
        place = schedule.stage_to_rank
        # each stage's recomputation (a replicated part's stages share theirs)
        self.rc = [plan.recompute_of(schedule.parts[i]) for i in range(len(stages))]
        self.times = [
            st.times(
                self.devices[place[i]],
                plan.dtype,
                recompute=self.rc[i],
                links=self.axes[place[i]],
            )
            for i, st in enumerate(stages)
        ]
        self.gather = [self._zero3_gather(i) for i in range(len(stages))]
        self.issue = issue_times(
            stages, [self.devices[place[i]] for i in range(len(stages))], self.rc
        )
        self.offloaded = self._offloaded()
        self.durations = self._durations()
        self.transfers = self._transfers()
        self.sharing = (
            replica_sharing(cluster, plan, dp_rank) if cluster.shares_processors else None
        )
        # one window, or a run whose middle windows are in the steady state
        steady = schedule.reach == 0 and schedule.policy == "sync"
        self.num_windows = 1 if steady else schedule.reach + 4

    def _offloaded(self) -> list[tuple[float, float]]:
        """Per stage: (saved bytes its offloaded blocks move to the host per micro-batch, the
        largest of them: the one block whose activations are on the device while it
        computes), under the plan's recomputation."""
        out, first = [], 0
        chosen = offloaded_blocks(
            self.plan.offload_activations, sum(len(st.blocks) for st in self.stages)
        )
        for st, rc in zip(self.stages, self.rc, strict=True):
            moved = [b.saved_for(rc) for i, b in enumerate(st.blocks) if first + i in chosen]
            out.append((sum(moved), max(moved, default=0.0)))
            first += len(st.blocks)
        return out

    def _param_bytes(self, stage: int) -> float:
        return self.stages[stage].num_params * dtype_bytes(self.plan.dtype)

    def _zero3_gather(self, stage: int) -> float:
        st, links = self.stages[stage], self.axes[self.s.stage_to_rank[stage]]
        return weight_gather_time(
            st.num_params, st.expert_params, layout=self.plan, links=links,
            param_bytes=dtype_bytes(self.plan.dtype),
        )  # fmt: skip

    def _durations(self) -> dict[Op, list[float]]:
        t, g, place, plan = self.times, self.gather, self.s.stage_to_rank, self.plan
        n = len(self.stages)
        bandwidth = [self.devices[place[i]].memory_bandwidth_Bps for i in range(n)]
        update = [
            moe_optimizer_step_time(
                self.stages[i].num_params,
                self.stages[i].expert_params,
                self.devices[place[i]],
                layout=plan,
                dtype=plan.dtype,
                optimizer=plan.optimizer,
            )
            for i in range(n)
        ]
        if self.s.num_parts != self.s.num_stages:  # replicated parts (Chimera)
            update = [u + self._replica_sum(i, bandwidth[i]) for i, u in enumerate(update)]
        # offloaded activations cross the host link out in forward, back before backward
        host = [offload_time(self.offloaded[i][0], self.devices[place[i]]) for i in range(n)]
        if plan.offload_optimizer:  # the state in before the step, out after it
            for i in range(n):
                state = self._state(i).optimizer
                update[i] += 2 * offload_time(state, self.devices[place[i]])
        issue = self.issue
        post = posting_times(self.s, [self.devices[place[i]] for i in range(n)])
        return {
            Op.F: [
                max(x.forward_s + y + h, issue[Op.F][i]) + m
                for i, (x, y, h, m) in enumerate(zip(t, g, host, post, strict=True))
            ],
            Op.B: [
                max(x.backward_s + y + h, issue[Op.B][i]) + m
                for i, (x, y, h, m) in enumerate(zip(t, g, host, post, strict=True))
            ],
            Op.BI: [
                max(x.backward_input_s + y + h, issue[Op.BI][i]) + m
                for i, (x, y, h, m) in enumerate(zip(t, g, host, post, strict=True))
            ],
            Op.BW: [max(x.backward_weight_s, issue[Op.BW][i]) for i, x in enumerate(t)],
            Op.REDUCE: [self.dp_sync_time(i) for i in range(n)],
            Op.UPDATE: update,
            # a copy reads and writes the weights; a prediction also reads the direction
            Op.STASH: [2 * self._param_bytes(i) / bandwidth[i] for i in range(n)],
            Op.PREDICT: [3 * self._param_bytes(i) / bandwidth[i] for i in range(n)],
            Op.FREE: [0.0] * n,
        }

    def _transfers(self) -> dict[Op, list[float]]:
        place, n = self.s.stage_to_rank, len(self.stages)
        forward, backward = [0.0] * n, [0.0] * n
        for i, j in enumerate(self.s.graph[1]):
            if j >= 0:
                link = self.cluster.link(self.ranks[place[i]], self.ranks[place[j]])
                forward[i] = backward[j] = link.time(self.stages[i].activation_bytes)
        return {Op.SEND_F: forward, Op.SEND_B: backward}

    def _replica_sum(self, stage: int, bandwidth: float) -> float:
        """Before its update, `stage`'s gradient is summed over the ranks holding its part
        (`plait.parallel.replicas`: copied into one buffer, all-reduced, copied back; the
        runtime reduces a rank's parts in one buffer, charged here part by part)."""
        place = self.s.stage_to_rank
        holders = sorted({place[s] for s in self.s.replicas(self.s.parts[stage])})
        if len(holders) < 2:  # the replicas share a rank: added in place
            return 0.0
        link = self.cluster.link(self.ranks[holders[0]], self.ranks[holders[1]])
        grads = self._param_bytes(stage)
        return all_reduce_time(len(holders), grads, link) + 2 * grads / bandwidth

    def dp_sync_time(self, stage: int) -> float:
        """Gradient reduction of one stage: its non-expert gradients over axis "dp", its
        expert gradients over axis "edp" (`stage_sync_time`)."""
        plan, st, rank = self.plan, self.stages[stage], self.s.stage_to_rank[stage]
        return stage_sync_time(
            plan.compress, st.num_params, st.expert_params, layout=plan, links=self.axes[rank],
            device=self.devices[rank], param_bytes=dtype_bytes(plan.dtype),
        )  # fmt: skip

    def run(self) -> ReplicaRun:
        unrolled, result = replayed(
            self.s, self.num_windows, self.durations, self.transfers, self.sharing
        )
        if not result.completed:
            stuck = "; ".join(f"rank {b.rank} at {b.action}" for b in result.blocked)
            raise ValueError(
                f"schedule {self.s.kind} deadlocks under the cost model: {stuck}; "
                "validate it with plait.schedule.validate"
            )
        first, span = self._steady(result, unrolled)
        walks = self._walks(result, unrolled, first)
        if span is None:  # one window: from the start to the last compute, then the update
            span = max(w.compute_end for w in walks)
            step = max(w.end for w in walks)
        else:
            step = span
        if self.plan.single_process:
            # one process (torchgpipe's) issues every rank's actions through one interpreter:
            # its host time is serialised, so the step lasts at least its sum; when the host
            # binds, some action is always ready to issue (each finishes on its device within
            # its own issue time), so the sum is the step
            host = host_window_s(self.s, self.issue)
            span, step = max(span, host), max(step, host)
        reports = tuple(self._rank(rank, walks[rank], step) for rank in range(self.plan.pp))
        busy = sum(w.busy + (0.0 if self.num_windows == 1 else w.update) for w in walks)
        return ReplicaRun(result, reports, span, busy, step)

    def _steady(self, result: Replay, unrolled: Unrolled) -> tuple[int, float | None]:
        """(the first window counted as steady, the steady window period or None for a run
        of one window)."""
        if unrolled.num_windows == 1:
            return 0, None
        ends = window_ends(result, unrolled.starts)
        first = self.s.reach + 1
        return first, (ends[-1] - ends[first - 1]) / (len(ends) - first)

    def _walks(self, result: Replay, unrolled: Unrolled, first: int) -> list[Walk]:
        saved = [
            st.saved_bytes(rc) - moved[0]
            for st, moved, rc in zip(self.stages, self.offloaded, self.rc, strict=True)
        ]
        copy = [self._param_bytes(i) for i in range(len(self.stages))]
        read = walk_events if REFERENCE_WALK else walk
        return walked(read, self.plan.pp, result, unrolled, first, saved, copy)

    def _rank(self, rank: int, walk: Walk, step: float) -> RankReport:
        mine = self.s.stages_of(rank)
        m = self.s.num_microbatches
        ep_comm = m * sum(self.times[i].ep_comm_s for i in mine)
        tp_comm = m * sum(
            self.times[i].comm_forward_s + self.times[i].comm_backward_s + 2 * self.gather[i]
            for i in mine
        )
        tp_comm -= ep_comm
        cp_comm = m * sum(self.times[i].cp_comm_s for i in mine)
        return RankReport(
            pp_rank=rank,
            global_rank=self.ranks[rank],
            device=self.devices[rank].name,
            compute_s=walk.busy - tp_comm - ep_comm - cp_comm,
            tp_comm_s=tp_comm,
            p2p_s=walk.p2p,
            dp_comm_s=walk.reduce,
            optimizer_s=walk.update,
            end_s=walk.end if self.num_windows == 1 else step,
            memory=self._memory(rank, mine, walk),
            capacity_bytes=float(self.devices[rank].memory_bytes),
            ep_comm_s=ep_comm,
            cp_comm_s=cp_comm,
        )

    def _state(self, *stages: int) -> ModelState:
        """Model-state bytes of `stages` together on one rank."""
        plan = self.plan
        return expert_state_bytes(
            sum(self.stages[i].num_params for i in stages),
            sum(self.stages[i].expert_params for i in stages),
            layout=plan,
            dtype=plan.dtype,
            optimizer=plan.optimizer,
        )

    def _memory(self, rank: int, mine: list[int], walk: Walk) -> MemoryUse:
        plan = self.plan
        state = self._state(*mine)
        transient = max(
            self.stages[i].transient_bytes(self.rc[i]) + self.offloaded[i][1] for i in mine
        )
        if plan.zero == 3 and plan.dp > 1:
            transient += max(self._param_bytes(i) for i in mine)
        optimizer = state.optimizer
        if plan.offload_optimizer:  # on the device only for the step, without activations
            working = walk.activation_peak + transient + walk.copies_peak
            optimizer = swapped_optimizer_bytes(state.optimizer, working)
        return MemoryUse(
            params=state.params,
            grads=state.grads,
            optimizer=optimizer,
            activations=walk.activation_peak,
            transient=transient,
            weight_copies=walk.copies_peak,
        )


# what the layout walks below return, by (cluster, plan.layout, ranks...): every plan the
# planner simulates walks dp × pp groups, and its plans share a few hundred layouts; the
# answers depend on the plan only through its layout (degrees, rank order)
_BY_LAYOUT: dict[tuple[object, ...], object] = {}
_KEPT = 1 << 16


def _by_layout(key: tuple[object, ...], make: Callable[[], _T]) -> _T:
    if key not in _BY_LAYOUT:
        if len(_BY_LAYOUT) > _KEPT:
            _BY_LAYOUT.clear()
        _BY_LAYOUT[key] = make()
    return cast(_T, _BY_LAYOUT[key])


def signature(cluster: Cluster, plan: SimPlan, dp_rank: int) -> tuple[object, ...]:
    """What determines a replica's timing: its devices and the links it uses."""
    key = ("signature", cluster, plan.layout, dp_rank)
    return _by_layout(key, lambda: _signature(cluster, plan, dp_rank))


def _signature(cluster: Cluster, plan: SimPlan, dp_rank: int) -> tuple[object, ...]:
    ranks = [plan.global_rank(r, dp_rank) for r in range(plan.pp)]
    devices: list[Device] = [cluster.device(g) for g in ranks]
    links: list[Link] = [cluster.group_link(plan.tp_group(r, dp_rank)) for r in range(plan.pp)]
    links += [cluster.link(ranks[r], ranks[(r + 1) % plan.pp]) for r in range(plan.pp)]
    if plan.ep > 1:  # the token all-to-all and the expert gradients' groups
        links += [cluster.group_link(plan.ep_group(r, dp_rank)) for r in range(plan.pp)]
        links += [cluster.group_link(plan.expert_dp_group(r, dp_rank)) for r in range(plan.pp)]
    if plan.cp > 1:  # the K/V ring's group
        links += [cluster.group_link(plan.layout.ranks("cp", g)) for g in ranks]
    shared = replica_sharing(cluster, plan, dp_rank) if cluster.shares_processors else None
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


def _axis_links(cluster: Cluster, plan: SimPlan, pp_rank: int, dp_rank: int) -> AxisLinks:
    """The degree and link of each axis a stage's collectives and gradient reductions run
    over, from rank (pp_rank, dp_rank, tp rank 0)'s groups; the axes of one rank cost
    nothing."""
    key = ("axes", cluster, plan.layout, pp_rank, dp_rank)
    return _by_layout(key, lambda: _axis_links_of(cluster, plan, pp_rank, dp_rank))


def _axis_links_of(cluster: Cluster, plan: SimPlan, pp_rank: int, dp_rank: int) -> AxisLinks:
    degrees = {"tp": plan.tp, "ep": plan.ep, "cp": plan.cp, **sync_degrees(plan)}
    rank = plan.global_rank(pp_rank, dp_rank)
    groups = {axis: plan.layout.ranks(axis, rank) for axis in degrees}
    if plan.cp > 1:  # gradients are reduced over dp × cp (the runtime's dp_cp group)
        groups["dp"] = sorted({r for c in groups["cp"] for r in plan.layout.ranks("dp", c)})
    links = {axis: cluster.group_link(g) for axis, g in groups.items() if degrees[axis] > 1}
    return AxisLinks(degrees, links)
