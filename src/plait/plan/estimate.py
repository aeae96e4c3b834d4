"""Closed-form estimates of a plan's step time and memory, to rank candidates before the
simulator replays the most promising ones exactly.

A synchronous step is estimated as a pipeline that is filled once and then paced by its
slowest rank: (m - 1)·T_max + ΣT_r (Huang et al. 2019's (m + p - 1)·T for equal stages),
the fill cut to the share of 1F1B's idle time that the kind leaves (its paper's closed
form, `ScheduleKind.bubble`: 1/v interleaved, a third for ZB-H1, none for ZB-H2 and ZB-V
from 2p - 1 micro-batches, (p - 2)/(2(p - 1)) for Chimera); plus the point-to-point
latency of filling and draining, the exposed gradient reduction of the first stage and
the optimizer step. An asynchronous window never fills nor drains: it is paced by its
slowest rank, m·T_max, plus that rank's updates (each waits for its reduction, then
steps the optimizer) and weight copies. Memory follows each schedule's in-flight
micro-batches on each rank and its weight copies (the registry's closed forms,
`plait.schedule.registry`). Under expert parallelism the experts' all-to-alls are part
of each block's time (over the ep group's link) and expert gradients and model state are
reduced and sharded over the dp·tp / ep ranks that hold the same experts. The estimates
are only used to order the search; every reported number comes from the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from plait.cluster import Cluster, Link, dtype_bytes
from plait.cost import (
    AxisLinks,
    BlockCost,
    block_times,
    expert_dp_degree,
    model_state_bytes,
    moe_optimizer_step_time,
    shard_degree,
    stage_sync_time,
    sync_degrees,
    weight_gather_time,
)
from plait.plan.balanced import balanced_sizes
from plait.plan.held import held, inflight, least_held
from plait.schedule import schedule_kind
from plait.sim import SimPlan

__all__ = ["Estimate", "Estimator", "RankProfile", "bound", "estimate", "inflight"]


@dataclass(frozen=True)
class Estimate:
    step_s: float
    memory_bytes: tuple[float, ...]  # per pipeline rank
    capacity_bytes: float
    sizes: tuple[int, ...]  # blocks per (virtual) stage
    # whether another cut of the blocks could fit: the least memory any cut needs, summed
    # over the ranks, is within their capacity summed (a necessary condition only)
    other_cut_may_fit: bool = True

    @property
    def excess_bytes(self) -> float:
        return max(self.memory_bytes) - self.capacity_bytes

    @property
    def fits(self) -> bool:
        return self.excess_bytes <= 0


@dataclass(frozen=True)
class RankProfile:
    """Per pipeline rank sums of a balanced split (numpy arrays of length pp)."""

    sizes: tuple[int, ...]
    forward_s: np.ndarray
    backward_input_s: np.ndarray
    backward_weight_s: np.ndarray
    params: np.ndarray
    stage_params: np.ndarray  # per (virtual) stage
    saved: np.ndarray
    transient: np.ndarray
    activation_bytes: float
    experts: np.ndarray | None = None  # expert parameters among `params` (None: no experts)
    stage_experts: np.ndarray | None = None

    # what `bound` reads of each of tens of thousands of candidates, summed once per profile
    @cached_property
    def slowest_s(self) -> float:
        """The slowest rank's forward and backward of one micro-batch."""
        return float((self.forward_s + self.backward_input_s + self.backward_weight_s).max())

    @cached_property
    def saved_total(self) -> float:
        return float(self.saved.sum())

    @cached_property
    def params_total(self) -> float:
        return float(self.params.sum())


@dataclass(frozen=True)
class _BlockArrays:
    """Per-block seconds and bytes of one model variant under one recomputation mode."""

    forward_s: np.ndarray
    backward_input_s: np.ndarray
    backward_weight_s: np.ndarray
    params: np.ndarray
    saved: np.ndarray
    transient: np.ndarray
    activation_bytes: np.ndarray
    experts: np.ndarray


class Estimator:
    """Estimates for many plans of one model on one cluster. What plans share is computed
    once: per-block times for each model variant, the balanced split for each stage count
    (shared by micro-batch sizes, whose work scales every block alike), and links."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.device = cluster.device(0)
        group = cluster.groups[0]
        if group.processors is not None and group.processors < group.devices_per_node:
            # devices time-sharing processors: the closed form charges each its mean share
            # (the simulator that checks the best candidates shares them moment by moment)
            share = group.sharing_efficiency * group.processors / group.devices_per_node
            self.device = replace(self.device, efficiency=self.device.efficiency * share)
        self._arrays: dict[tuple[object, ...], _BlockArrays] = {}
        self._splits: dict[tuple[object, ...], list[int]] = {}
        self._profiles: dict[tuple[object, ...], RankProfile] = {}
        self._links: dict[tuple[object, ...], Link] = {}
        self._state: dict[tuple[object, ...], float] = {}
        self._syncs: dict[tuple[object, ...], float] = {}
        self._opts: dict[tuple[object, ...], float] = {}
        # uneven cuts within memory (`plait.plan.prune.uneven_cut`) by what shapes them
        self.cuts: dict[tuple[object, ...], tuple[int, ...] | None] = {}

    def link(self, plan: SimPlan, axis: str) -> Link:
        key = (axis, plan.layout)
        if key not in self._links:
            if axis == "pp":  # the first stage's send to the next
                group = [plan.global_rank(0), plan.global_rank(min(1, plan.pp - 1))]
            elif axis == "dp" and plan.cp > 1:  # gradients are reduced over dp × cp
                group = [r for c in plan.layout.ranks("cp", 0) for r in plan.layout.ranks("dp", c)]
            else:
                group = plan.layout.ranks(axis, 0)
            self._links[key] = self.cluster.group_link(group)
        return self._links[key]

    def sync_links(self, plan: SimPlan) -> AxisLinks:
        """The groups gradients are reduced over: axis "dp" (its dp_replicate and dp_shard
        parts under hybrid sharding) and, for experts, "edp"."""
        degrees = sync_degrees(plan)
        return AxisLinks(degrees, {axis: self.link(plan, axis) for axis in degrees})

    def _ep_key(self, plan: SimPlan) -> tuple[object, ...]:
        """What the ep and cp groups' links depend on (nothing without either)."""
        if plan.ep == 1 and plan.cp == 1:
            return ()
        return (plan.dp, plan.ep, plan.cp, plan.tp, plan.pp, plan.rank_order)

    def _block_arrays(self, plan: SimPlan, blocks: Sequence[BlockCost]) -> _BlockArrays:
        key = (id(blocks), plan.recompute, plan.dtype, *self._ep_key(plan))
        if key not in self._arrays:
            rc = plan.recompute
            degrees, links = {"tp": plan.tp}, {"tp": self.link(plan, "tp")}
            if plan.ep > 1:
                degrees["ep"], links["ep"] = plan.ep, self.link(plan, "ep")
            if plan.cp > 1:  # the K/V ring (plait.cost.context)
                degrees["cp"], links["cp"] = plan.cp, self.link(plan, "cp")
            axes = AxisLinks(degrees, links)
            times = block_times(blocks, self.device, plan.dtype, recompute=rc, links=axes)
            # each block action lasts at least its host issue (`plait.sim.host`, per block
            # here: a stage's max of sums is at most this sum of maxima)
            d = self.device.dispatch_s
            redo = d if rc == "full" else 0.0
            self._arrays[key] = _BlockArrays(
                np.array([max(t.forward_s, d) for t in times]),
                np.array([max(t.backward_input_s, d / 2 + redo) for t in times]),
                np.array([max(t.backward_weight_s, d / 2) for t in times]),
                np.array([b.num_params for b in blocks], dtype=float),
                np.array([b.saved_for(rc) for b in blocks]),
                np.array(
                    [0.0 if rc == "none" else b.saved_bytes - b.saved_for(rc) for b in blocks]
                ),
                np.array([b.activation_bytes for b in blocks]),
                np.array([b.expert_params for b in blocks], dtype=float),
            )
        return self._arrays[key]

    def profile(self, plan: SimPlan, blocks: Sequence[BlockCost]) -> RankProfile:
        ep = self._ep_key(plan)
        key = (id(blocks), plan.pp, plan.chunks, plan.recompute, plan.dtype, *ep)
        if key not in self._profiles:
            arrays = self._block_arrays(plan, blocks)
            stages = plan.pp * plan.chunks
            split_key = (stages, plan.recompute, plan.tp, plan.sequence_parallel, *ep)
            if split_key not in self._splits:
                work = arrays.forward_s + arrays.backward_input_s + arrays.backward_weight_s
                self._splits[split_key] = balanced_sizes(work.tolist(), stages)
            self._profiles[key] = _rank_sums(arrays, self._splits[split_key], plan.pp)
        return self._profiles[key]

    def state_per_param(self, plan: SimPlan, *, experts: bool = False) -> float:
        """Model-state bytes per parameter (linear in the parameter count), ZeRO sharding
        over the plan's dp ranks, or for `experts` over the ranks holding the same ones."""
        # keyed by the plan's own fields: deriving its shard degree costs more than the rest
        key = (experts, plan.dtype, plan.zero, plan.optimizer, plan.dp, plan.dp_replicate,
               plan.dp_shard, plan.cp, plan.tp, plan.ep)  # fmt: skip
        if key not in self._state:
            dp = expert_dp_degree(plan) if experts else shard_degree(plan)
            big = 1e9
            self._state[key] = (
                model_state_bytes(
                    big,
                    dtype=plan.dtype,
                    zero_stage=plan.zero,
                    dp=dp,
                    optimizer=plan.optimizer,
                ).total
                / big
            )
        return self._state[key]

    def sync_time(self, plan: SimPlan, params: float, experts: float, links: AxisLinks) -> float:
        """`stage_sync_time` of one rank's `params`, cached: the balanced stages of a
        split hold the same parameters, and many plans share a data-parallel layout."""
        key = (params, experts, plan.compress, plan.layout, plan.zero, plan.dtype, plan.ep)
        if key not in self._syncs:
            self._syncs[key] = stage_sync_time(
                plan.compress, params, experts, layout=plan, links=links, device=self.device,
                param_bytes=dtype_bytes(plan.dtype),
            )  # fmt: skip
        return self._syncs[key]

    def optimizer_time(self, plan: SimPlan, params: float, experts: float) -> float:
        """`moe_optimizer_step_time` of one rank's `params`, cached like `sync_time`."""
        key = (params, experts, plan.layout, plan.zero, plan.dtype, plan.optimizer, plan.ep)
        if key not in self._opts:
            self._opts[key] = moe_optimizer_step_time(
                params, experts, self.device, layout=plan, dtype=plan.dtype,
                optimizer=plan.optimizer,
            )  # fmt: skip
        return self._opts[key]

    def estimate(self, plan: SimPlan, blocks: Sequence[BlockCost]) -> Estimate:
        return estimate(plan, self.profile(plan, blocks), self)

    def bound(self, plan: SimPlan, blocks: Sequence[BlockCost]) -> Estimate:
        return bound(plan, self.profile(plan, blocks), self)

    def estimate_cut(
        self, plan: SimPlan, blocks: Sequence[BlockCost], sizes: Sequence[int]
    ) -> Estimate:
        """`estimate` with the blocks cut into `sizes` per (virtual) stage instead of the
        balanced cut (an uneven cut that fits where the balanced one does not)."""
        arrays = self._block_arrays(plan, blocks)
        return estimate(plan, _rank_sums(arrays, list(sizes), plan.pp), self)


def _rank_sums(arrays: _BlockArrays, sizes: list[int], p: int) -> RankProfile:
    starts = np.cumsum([0, *sizes[:-1]])
    v = len(sizes) // p

    def per_rank(values: np.ndarray, *, peak: bool = False) -> np.ndarray:
        stages = (np.maximum if peak else np.add).reduceat(values, starts)
        by_chunk = stages.reshape(v, p)
        return by_chunk.max(axis=0) if peak else by_chunk.sum(axis=0)

    stage_params = np.add.reduceat(arrays.params, starts)
    moe = bool(arrays.experts.any())
    return RankProfile(
        tuple(sizes),
        per_rank(arrays.forward_s),
        per_rank(arrays.backward_input_s),
        per_rank(arrays.backward_weight_s),
        per_rank(arrays.params),
        stage_params,
        per_rank(arrays.saved),
        per_rank(arrays.transient, peak=True),
        float(arrays.activation_bytes[sizes[0] - 1]),
        per_rank(arrays.experts) if moe else None,
        np.add.reduceat(arrays.experts, starts) if moe else None,
    )


def bound(plan: SimPlan, profile: RankProfile, est: Estimator) -> Estimate:
    """A lower bound on `estimate`'s step, m × the slowest rank's compute (every schedule
    runs m micro-batches through its slowest rank; collectives, bubble and updates only
    add), with the estimate's memory: cheap enough to prune candidates before estimating."""
    return bounds([plan], profile, est)[0]


def bounds(plans: Sequence[SimPlan], profile: RankProfile, est: Estimator) -> list[Estimate]:
    """`bound` of each of `plans`, which share `profile` (the planner's tens of thousands of
    candidates share a few thousand cuts): their memory as rows of one array."""
    state, memory = _memory(plans, profile, est)
    # any cut holds the same model state over all ranks, and at least the fewest
    # micro-batches (and weight copies) any rank holds of every block; a row's sum is
    # that row's alone (numpy sums each contiguous row alike)
    totals, per_rank = state.sum(axis=1).tolist(), memory.tolist()
    capacity = float(est.device.memory_bytes)
    out = []
    for plan, total, row in zip(plans, totals, per_rank, strict=True):
        least, copies = least_held(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
        floor = (
            total
            + least * profile.saved_total
            + copies * profile.params_total * dtype_bytes(plan.dtype)
        )
        fits_other = floor <= plan.pp * capacity
        step = plan.microbatches * profile.slowest_s
        out.append(Estimate(step, tuple(row), capacity, profile.sizes, fits_other))
    return out


def _memory(
    plans: Sequence[SimPlan], profile: RankProfile, est: Estimator
) -> tuple[np.ndarray, np.ndarray]:
    """(model state, memory) of `plans` on `profile`'s cut, a row per plan and a column
    per pipeline rank: the state (twice over for Chimera, which replicates each part),
    in-flight activations, transients, weight copies."""
    twice = np.array([2 if schedule_kind(p.schedule).replicated else 1 for p in plans])
    per = np.array([est.state_per_param(p) for p in plans])[:, None]
    if profile.experts is None:  # (params - 0) · s + 0 · s_experts is params · s to the bit
        state = profile.params * per * twice[:, None]
    else:
        experts = profile.experts
        per_expert = np.array([est.state_per_param(p, experts=True) for p in plans])[:, None]
        state = ((profile.params - experts) * per + experts * per_expert) * twice[:, None]
    shapes = [held(p.schedule, p.pp, p.microbatches, p.chunks) for p in plans]
    counts = np.array([c for c, _ in shapes])
    copies = np.array([c for _, c in shapes])
    pbytes = np.array([dtype_bytes(p.dtype) for p in plans])[:, None]
    memory = state + counts * profile.saved + profile.transient + copies * profile.params * pbytes
    return state, memory


def estimate(plan: SimPlan, profile: RankProfile, est: Estimator) -> Estimate:
    """Estimated step time and per-rank memory of `plan` on the cluster's first device kind."""
    kind = schedule_kind(plan.schedule)
    p, v, m = plan.pp, plan.chunks, plan.microbatches
    pbytes = dtype_bytes(plan.dtype)
    work = profile.forward_s + profile.backward_input_s + profile.backward_weight_s
    rank_experts = np.zeros(p) if profile.experts is None else profile.experts
    stage_experts = (
        np.zeros(len(profile.stage_params))
        if profile.stage_experts is None
        else profile.stage_experts
    )
    links = est.sync_links(plan)
    if plan.zero == 3:  # weights gathered for forward and backward
        per_stage = np.array(
            [
                weight_gather_time(n, x, layout=plan, links=links, param_bytes=pbytes)
                for n, x in zip(profile.stage_params, stage_experts, strict=True)
            ]
        )
        work = work + 2 * per_stage.reshape(v, p).sum(axis=0)
    p2p = 2 * (p - 1) * v * est.link(plan, "pp").time(profile.activation_bytes) if p > 1 else 0.0
    # per rank: its gradients' reduction, the experts' over the ranks holding the same
    # experts, exactly as the simulator prices a stage's (`stage_sync_time`)
    syncs = np.array(
        [
            est.sync_time(plan, float(n), float(x), links)
            for n, x in zip(profile.params, rank_experts, strict=True)
        ]
    )
    opts = np.array(
        [
            est.optimizer_time(plan, float(n), float(x))
            for n, x in zip(profile.params, rank_experts, strict=True)
        ]
    )
    if kind.synchronous:
        # the slowest rank paces m micro-batches; the fill and drain leave the kind's
        # share of 1F1B's idle time, the other ranks' work for one micro-batch
        slowest = float(work.max())
        idle = (float(work.sum()) - slowest) * kind.bubble(p, m, v)
        step = m * slowest + idle + p2p + float(syncs[0]) + float(opts.max())
    else:  # every update waits for its reduction; each copy passes over the weights twice
        copies = held(plan.schedule, p, m, v)[1]
        updates = m if kind.per_microbatch else 1
        stash = (
            2 * profile.params * pbytes / est.device.memory_bandwidth_Bps * np.minimum(copies, 1)
        )
        step = float((m * work + updates * (syncs + opts + stash)).max()) + p2p / (p or 1)
    memory = _memory([plan], profile, est)[1][0]
    return Estimate(step, tuple(memory.tolist()), float(est.device.memory_bytes), profile.sizes)
