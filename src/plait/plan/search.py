"""The planner's search: enumerate layouts, rank them by estimate, simulate the best exactly.

Every (dp, tp, pp) factorisation that keeps tensor parallelism inside a node, every
micro-batch size that divides the batch, every schedule (with its chunk counts), every
recomputation mode and ZeRO stage is a candidate. When the space is small (at most
`exact_limit` candidates) all of them are simulated; otherwise closed-form estimates
(`plait.plan.estimate`) order them and only the most promising are partitioned exactly
(`partition_blocks`, memory caps included) and replayed by the simulator, within a budget
of replayed work. Every registered schedule kind is searched (asynchronous ones with
`allow_staleness`); bounds keep that fast: a candidate whose memory does not fit, or whose
lower bound on the step is slower than the estimates that could still be simulated and
than the fastest of its kind, is never estimated in full (`plait.plan.prune`). Given the
input pipeline's rate, a plan's step is at least the time each data-parallel replica takes
to load its batch (`search`'s `loader_samples_per_s`).
Alpa (Zheng et al. 2022) and Galvatron (Miao et al. 2022) search similar spaces
with compilation passes or dynamic programming over layers; plait's layers are
homogeneous blocks, so it searches whole-model layouts and lets the simulator judge.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import cast

from plait.cluster import Cluster
from plait.cost import Optimizer, Recompute
from plait.plan.depths import depth_plans, template_of
from plait.plan.describe import describe
from plait.plan.estimate import Estimate
from plait.plan.exact import NoFeasiblePlan, RankedPlan, Rejection, exact_of
from plait.plan.lighter import lighter_recompute
from plait.plan.loader import check_rate, with_loader
from plait.plan.offload import OPTIONS, best_key_of, offloaded, offloads
from plait.plan.prune import fastest_of_each_kind, fastest_without_cp, order_key, pruned_estimates
from plait.plan.space import ModelSpec, SearchSpace, candidates
from plait.plan.wsp import wsp_variants
from plait.schedule.pause import gc_paused
from plait.sim import SimPlan

__all__ = ["NoFeasiblePlan", "PlanSearch", "RankedPlan", "Rejection", "describe", "search"]

_GIB = 2.0**30


@dataclass(frozen=True)
class PlanSearch:
    ranked: tuple[RankedPlan, ...]
    rejected: tuple[Rejection, ...]
    num_candidates: int
    num_simulated: int
    plan_seconds: float
    top_k: int = 5
    # why the plans offload to host memory (empty when they do not): nothing fit without
    offload_reason: str = ""
    # the fastest estimate that fits of each schedule kind, fastest first (the explanation
    # names the runner-up of every kind, simulated or not)
    kind_estimates: tuple[tuple[Estimate, SimPlan], ...] = ()
    # the fastest estimate that fits with cp=1, when the search tried cp > 1 (the
    # explanation compares a context-parallel winner with it)
    without_cp: tuple[Estimate, SimPlan] | None = None

    @property
    def top(self) -> tuple[RankedPlan, ...]:
        return self.ranked[: self.top_k]

    @property
    def best(self) -> RankedPlan:
        return self.ranked[0]


# stage-micro-batches the search replays before it may stop (`search`): about 3 s of this
# simulator's replays of a GPT-3-sized 1F1B or ZB pipeline on one core
REPLAY_BUDGET = 20_000


def replay_work(plan: SimPlan) -> int:
    """What one simulation of `plan` replays, in stage-micro-batches: (virtual) stages ×
    micro-batches of its largest share (replicas alike are replayed once)."""
    return plan.pp * plan.chunks * plan.microbatches


def _preference(
    r: RankedPlan,
) -> tuple[int, bool, bool, bool, bool, int, int, bool, int, float, float]:
    """Fastest first; among plans equally fast (to 0.1%), the simpler one: equal shares,
    exact gradients (no compression), fresh weights (no WSP), nothing in host memory, less
    sharding, less
    recomputation, the least context
    parallelism, then (when the input pipeline is modelled, and many plans wait for it
    alike) the least device time, then the most memory left."""
    p = r.plan
    step = round(math.log(max(r.step_time_s, 1e-12)) / math.log(1.001))  # 0.1% buckets
    return (
        step,
        p.total_microbatches > 0,
        p.compress != "none",
        p.wsp_staleness is not None,
        offloads(p),
        p.zero,
        ("none", "selective", "full").index(p.recompute),
        p.sequence_parallel,
        p.cp,
        r.simulated_step_s if r.loader_step_s else 0.0,
        max(r.peak_memory_bytes),
    )


def _with_margin(ranked: RankedPlan, margin: float) -> RankedPlan | Rejection:
    spare = min(
        (c - m) / c for c, m in zip(ranked.capacity_bytes, ranked.peak_memory_bytes, strict=True)
    )
    if spare >= margin:
        return ranked
    short = max(
        m - (1 - margin) * c
        for c, m in zip(ranked.capacity_bytes, ranked.peak_memory_bytes, strict=True)
    )
    return Rejection(
        ranked.plan,
        f"leaves {spare:.1%} of device memory free, under the {margin:.0%} margin",
        short,
    )


# a search holds tens of thousands of plans and estimates, none in a reference cycle; the
# cyclic collector walked them all again and again (7 full collections, 2 s of the 1T
# GPT's plan) and found nothing to free
@gc_paused()
def search(
    model: ModelSpec,
    cluster: Cluster,
    *,
    global_batch: int,
    num_devices: int | None = None,
    space: SearchSpace | None = None,
    top_k: int = 5,
    exact_limit: int = 300,
    max_simulated: int = 24,
    replay_budget: int = REPLAY_BUDGET,
    memory_margin: float = 0.05,
    loader_samples_per_s: float | None = None,
    wsp_allowance: int | None = None,
) -> PlanSearch:
    """The best plans for training `model` on `cluster` with `global_batch` samples a step.

    A plan must leave `memory_margin` of each device's memory free (allocator
    fragmentation and buffers the model does not count).

    `loader_samples_per_s` is the input pipeline's rate, in samples per second per loading
    process (None or 0: not modelled, each plan's step is the simulator's). Each
    data-parallel replica's first pipeline stage loads that replica's batch (micro-batch
    size × micro-batches samples) in one process; a prefetching loader overlaps with
    compute, so a plan's step is max(simulated step, batch / rate), and plans are ranked
    by it (`RankedPlan.loader_step_s`, `input_bound`; limits in `plait.plan.loader`).

    Past `exact_limit` candidates, plans are simulated in the order of their estimates
    until `max_simulated` are, or until `top_k` fit and the simulations have replayed
    `replay_budget` stage-micro-batches (`replay_work`). The stop is counted in work, not
    in seconds, so a faster or idler machine decides the same plan.

    With `wsp_allowance` (waves of staleness, >= 0), every plan found that the runtime can
    train under WSP is ranked again with its D chosen within it (`plait.plan.wsp`)."""
    t0 = time.perf_counter()
    rate = check_rate(loader_samples_per_s, "loader_samples_per_s")
    if wsp_allowance is not None and wsp_allowance < 0:
        raise ValueError(f"wsp_allowance={wsp_allowance}: give the most waves of staleness, >= 0")
    if space is None:
        orders = ("tp-dp-pp",) if cluster.is_homogeneous else ("tp-dp-pp", "tp-pp-dp")
        space = SearchSpace(rank_orders=orders)
    devices = num_devices or cluster.num_devices
    if devices > cluster.num_devices:
        raise ValueError(
            f"num_devices={devices} but cluster {cluster.name!r} has {cluster.num_devices}"
        )
    per_node = cluster.groups[0].devices_per_node
    plans = list(
        candidates(
            model, space, num_devices=devices, devices_per_node=per_node, global_batch=global_batch
        )
    )
    if not plans:
        raise NoFeasiblePlan(
            f"no layout of {devices} devices divides global_batch={global_batch} with micro-"
            f"batch sizes {space.micro_batch_sizes}: use a batch divisible by the devices"
        )
    exhaustive = len(plans) <= exact_limit
    estimates, misfits = pruned_estimates(
        plans, model, cluster, None if exhaustive else max_simulated, rate
    )
    order = _order(estimates, exhaustive, rate)
    without_cp = fastest_without_cp(estimates, plans, rate)
    if without_cp is not None:  # simulated first: a plan with cp > 1 is judged against it
        order = [without_cp, *(x for x in order if x[1] != without_cp[1])]
    ranked: list[RankedPlan] = []
    rejected = [_short(e, p) for e, p in misfits]
    short: list[Rejection] = []  # replayed and over memory: offload may still fit them
    simulated = replayed = 0
    for _, plan in order:
        budget_gone = replayed >= replay_budget and len(ranked) >= top_k
        if not exhaustive and (simulated >= max_simulated or budget_gone):
            break
        outcome = exact_of(plan, cluster)(plan, model, cluster)
        simulated += 1
        replayed += replay_work(plan)
        if isinstance(outcome, RankedPlan):
            outcome = _with_margin(outcome, memory_margin)
        if isinstance(outcome, RankedPlan):
            ranked.append(with_loader(outcome, rate))
        else:
            rejected.append(outcome)
            if outcome.excess_bytes > 0:
                short.append(outcome)
    found_depths, replayed_depths = _depth_plans(ranked, model, cluster, space, devices,
                                                 global_batch)  # fmt: skip
    simulated += replayed_depths
    for outcome in found_depths:
        outcome = (
            _with_margin(outcome, memory_margin) if isinstance(outcome, RankedPlan) else outcome
        )
        if isinstance(outcome, RankedPlan):
            ranked.append(with_loader(outcome, rate))
        else:
            rejected.append(outcome)
    reason = ""
    if not ranked and space.offload:  # the memory savers that cost host-link time, tried last
        reason, found = _offloaded(rejected, model, cluster, max_simulated)
        margined = [_with_margin(x, memory_margin) for x in found if isinstance(x, RankedPlan)]
        ranked = [with_loader(r, rate) for r in margined if isinstance(r, RankedPlan)]
        simulated += len(found)
    elif ranked and space.offload:  # plans that fit only with offload, where they could win
        failed = [*((e.step_s, p) for e, p in misfits), *((None, r.plan) for r in short)]
        found = offloaded(failed, best_key_of(ranked), model, cluster, margin=memory_margin,
                          limit=max_simulated if exhaustive else top_k, rate=rate,
                          budget=None if exhaustive else replay_budget - replayed)  # fmt: skip
        simulated += len(found)
        margined = [_with_margin(o, memory_margin) for o in found if isinstance(o, RankedPlan)]
        ranked += [with_loader(r, rate) for r in margined if isinstance(r, RankedPlan)]
    if wsp_allowance is not None:
        waves = wsp_variants(ranked, model, cluster, wsp_allowance, memory_margin)
        ranked += [with_loader(v, rate) for v in waves]
    ranked.sort(key=_preference)
    if ranked and not reason and offloads(ranked[0].plan):
        reason = _offload_wins(ranked, rejected)
    lighter = _lighter(ranked[:top_k], model, cluster, memory_margin)
    if lighter is not None:
        ranked = sorted([*ranked, with_loader(lighter, rate)], key=_preference)
        simulated += 1
    if not ranked:
        raise NoFeasiblePlan(_nothing_fits(rejected, model, cluster, devices))
    # every simulated plan that fits stays ranked (the explanation looks past variants of
    # the winner for a different layout); `top` is what a report shows
    return PlanSearch(
        tuple(ranked),
        tuple(rejected),
        len(plans),
        simulated,
        time.perf_counter() - t0,
        top_k=top_k,
        offload_reason=reason,
        kind_estimates=fastest_of_each_kind(estimates, rate),
        without_cp=without_cp,
    )


def _depth_plans(
    ranked: list[RankedPlan], model: ModelSpec, cluster: Cluster, space: SearchSpace,
    devices: int, global_batch: int,
) -> tuple[list[RankedPlan | Rejection], int]:  # fmt: skip
    """Pipelines of different depths (`plait.plan.depths`), with the options of the best
    plans of one depth, or (when none fits) of the space's smallest micro-batches."""
    if cluster.is_homogeneous:
        return [], 0
    best = sorted(ranked, key=_preference)
    if best:
        templates = [template_of(r.plan) for r in best[:3]]
    else:
        sizes = sorted(b for b in space.micro_batch_sizes if global_batch % b == 0)[:2]
        templates = [
            SimPlan(schedule="1f1b", micro_batch_size=b, recompute=cast(Recompute, mode),
                    dtype=space.dtype, optimizer=cast(Optimizer, space.optimizer),
                    seq_len=model.seq_len)
            for b in sizes for mode in space.recompute
        ]  # fmt: skip
    unique = list(dict.fromkeys(templates))
    best_s = best[0].simulated_step_s if best else math.inf
    return depth_plans(model, cluster, unique, num_devices=devices, global_batch=global_batch,
                       best_s=best_s)  # fmt: skip


def _lighter(
    top: list[RankedPlan], model: ModelSpec, cluster: Cluster, margin: float
) -> RankedPlan | None:
    """The best of `top` that recomputes, each stage recomputing only what its memory
    needs (`plait.plan.lighter`), when some stage can recompute less."""
    first = next((r for r in top if r.plan.recompute != "none" and r.result is not None), None)
    found = first and lighter_recompute(first.plan, first.sizes, model, cluster, margin)
    return RankedPlan.of(found[0], first.sizes, found[1]) if first and found else None


def _offload_wins(ranked: list[RankedPlan], rejected: list[Rejection]) -> str:
    """Why the best plan offloads although other plans fit without offload."""
    best = ranked[0].plan
    plain = dataclasses.replace(best, offload_activations="none", offload_optimizer=False)
    over = next((r for r in rejected if r.plan == plain and r.excess_bytes > 0), None)
    need = f" ({over.excess_bytes / _GIB:.2f} GiB over without it)" if over else ""
    runner = next((r for r in ranked if not offloads(r.plan)), None)
    beats = (
        f", and beats the fastest plan without offload ({describe(runner.plan)}, "
        f"{runner.step_time_s:.4g} s a step) by {runner.step_time_s - ranked[0].step_time_s:.3g} s"
        if runner else ""
    )  # fmt: skip
    return f"its layout fits only with host memory{need}; it pays the host-link transfers{beats}"


def _offloaded(
    rejected: list[Rejection], model: ModelSpec, cluster: Cluster, limit: int
) -> tuple[str, list[RankedPlan | Rejection]]:
    """When no plan fits, the `limit` plans closest to fitting again with activations,
    optimizer state or both in host memory (`plait.train.offload`): (why, outcomes)."""
    # pipelines of their own are not offloaded (`plait.pipelines.check_hetero_plan`)
    short = sorted((r for r in rejected if r.excess_bytes > 0 and r.plan.pipelines is None),
                   key=lambda r: r.excess_bytes)  # fmt: skip
    if not short:
        return "", []
    closest = short[0]
    reason = (
        f"no plan fits in device memory without offload (the closest, "
        f"{describe(closest.plan)}, is {closest.excess_bytes / _GIB:.2f} GiB over): "
        "it swaps to host memory and pays the host-link transfers"
    )
    found = [
        exact_of(r.plan, cluster)(dataclasses.replace(r.plan, **option), model, cluster)
        for r in short[:limit]
        for option in OPTIONS
    ]
    return reason, found


def _order(
    estimates: list[tuple[Estimate, SimPlan]], exhaustive: bool, rate: float | None
) -> list[tuple[Estimate, SimPlan]]:
    pool = estimates if exhaustive else [x for x in estimates if x[0].fits]
    return sorted(pool, key=lambda x: order_key(x[0].step_s, x[1], rate))


def _short(e: Estimate, plan: SimPlan) -> Rejection:
    """`plan`, set aside by its estimate `e` (tens of thousands of plans a large search:
    the peak is read once)."""
    need, capacity = max(e.memory_bytes), e.capacity_bytes
    reason = (
        f"needs about {need / _GIB:.1f} GiB on a device of {capacity / _GIB:.1f} GiB "
        f"({(need - capacity) / _GIB:.1f} GiB over)"
    )
    return Rejection(plan, reason, need - capacity)


def _nothing_fits(
    rejected: list[Rejection], model: ModelSpec, cluster: Cluster, devices: int
) -> str:
    """Which resource is short, by how much, and what would make it fit."""
    closest = min(rejected, key=lambda r: r.excess_bytes if r.excess_bytes > 0 else float("inf"))
    capacity = cluster.device(0).memory_bytes
    params = sum(b.num_params for b in model.blocks(1, SimPlan()))  # one rank holds all
    state = 16 * params  # mixed-precision Adam without ZeRO (Rajbhandari et al. 2020)
    need = max(devices, -(-int(2 * state) // int(capacity)))
    hints = []
    if closest.plan.recompute != "full":
        hints.append("full recomputation (--recompute full)")
    if closest.plan.micro_batch_size > 1:
        hints.append("a micro-batch size of 1")
    hints.append(f"more devices (about {need} for {state / _GIB:.0f} GiB of model state)")
    return (
        f"no plan of {model.name} fits on {devices} devices of {capacity / _GIB:.0f} GiB: device "
        f"memory is short; the closest plan ({describe(closest.plan)}) is "
        f"{closest.excess_bytes / _GIB:.2f} GiB over ({closest.reason}). It would fit with "
        + ", or ".join(hints)
    )
