"""A plan priced exactly: its stages cut within each device's memory, then simulated.

The search (`plait.plan.search`) estimates every candidate in closed form and prices the
most promising ones here. `RankedPlan` is a plan the simulator says fits, with its
prediction; `Rejection` one that does not, with how far over memory it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.cluster import Cluster
from plait.cost import StageCost
from plait.pipelines import hetero_refusal
from plait.plan.hetero import HeteroPlan, plan_replicas, split_replica
from plait.plan.partition import MemoryShortfall
from plait.plan.space import ModelSpec
from plait.sim import SimPlan, SimResult, build_schedule, simulate

__all__ = [
    "NoFeasiblePlan",
    "RankedPlan",
    "Rejection",
    "exact",
    "exact_hetero",
    "exact_of",
    "ranked_hetero",
    "runs_as_pipelines",
]

_GIB = 2.0**30


class NoFeasiblePlan(ValueError):
    """No plan of the space fits; the message says what is short and what would help."""


@dataclass(frozen=True)
class RankedPlan:
    """A plan the simulator says fits, with its prediction. On unequal devices each
    data-parallel replica (pipeline) has its own split and batch share (`hetero`)."""

    plan: SimPlan
    sizes: tuple[int, ...]  # blocks per (virtual) stage (of replica 0 when hetero)
    step_time_s: float
    bubble_fraction: float
    comm_share: float
    mfu: float
    tokens_per_s: float
    peak_memory_bytes: tuple[float, ...]  # per pipeline rank (worst replica when hetero)
    capacity_bytes: tuple[float, ...]
    result: SimResult | None = None
    hetero: HeteroPlan | None = None
    # seconds one loading process takes to load a replica's batch (0: input not modelled);
    # prefetching overlaps it with compute, so `step_time_s` is the longer of the two
    loader_step_s: float = 0.0
    # under WSP (`plan.wsp_staleness`): the replayed pace, seconds a step (0: synchronous)
    wsp_step_s: float = 0.0

    @property
    def simulated_step_s(self) -> float:
        """The simulator's step, before any wait for input."""
        if self.wsp_step_s:
            return self.wsp_step_s
        if self.hetero is not None:
            return self.hetero.step_time_s
        return self.result.step_time_s if self.result is not None else self.step_time_s

    @property
    def input_bound(self) -> bool:
        """The input pipeline, not the devices, sets the step time."""
        return self.loader_step_s > 0 and self.loader_step_s >= self.simulated_step_s

    @property
    def headroom_bytes(self) -> float:
        return min(c - m for c, m in zip(self.capacity_bytes, self.peak_memory_bytes, strict=True))

    @staticmethod
    def of(plan: SimPlan, sizes: tuple[int, ...], result: SimResult) -> RankedPlan:
        return RankedPlan(
            plan,
            sizes,
            result.step_time_s,
            result.bubble_fraction,
            result.comm_share,
            result.mfu,
            result.tokens_per_s,
            result.peak_memory_bytes,
            tuple(r.capacity_bytes for r in result.ranks),
            result=result,
        )


@dataclass(frozen=True)
class Rejection:
    plan: SimPlan
    reason: str
    excess_bytes: float = 0.0


def exact(plan: SimPlan, model: ModelSpec, cluster: Cluster) -> RankedPlan | Rejection:
    """Partition exactly under memory caps, then simulate."""
    blocks = model.blocks_for(plan)
    try:
        part = split_replica(plan, blocks, cluster)[1]
    except ValueError as err:
        return Rejection(plan, f"no stage split fits in memory: {err}", _excess(err))
    sizes = tuple(part.sizes)
    stage_list = [StageCost(tuple(s)) for s in part.split(list(blocks))]
    result = simulate(build_schedule(plan, check=False, lowered=False), stage_list, cluster, plan)
    if not result.fits:
        worst = max(result.overflows, key=lambda o: o.excess_bytes)
        return Rejection(plan, str(worst), worst.excess_bytes)
    return RankedPlan.of(plan, sizes, result)


def exact_hetero(plan: SimPlan, model: ModelSpec, cluster: Cluster) -> RankedPlan | Rejection:
    """Unequal devices: one split and batch share per pipeline (`plait.plan.hetero`)."""
    try:
        het = plan_replicas(plan, model, cluster)
    except ValueError as err:
        return Rejection(plan, str(err), _excess(err))
    return ranked_hetero(plan, het, model, cluster)


def ranked_hetero(
    plan: SimPlan, het: HeteroPlan, model: ModelSpec, cluster: Cluster
) -> RankedPlan | Rejection:
    """`plan` as its pipelines `het` price it: rejected when one is over memory, else
    ranked by the slowest (its memory the worst pipeline's)."""
    worst = max(
        het.replicas, key=lambda r: max(x.memory.total - x.capacity_bytes for x in r.run.ranks)
    )
    over = max(x.memory.total - x.capacity_bytes for x in worst.run.ranks)
    if over > 0:
        return Rejection(plan, f"pipeline {worst.dp_rank} is {over / _GIB:.2f} GiB over", over)
    step = het.step_time_s
    flops = sum(
        b.forward_flops + b.backward_input_flops + b.backward_weight_flops
        for b in model.blocks_for(plan)
    )
    total_flops = flops * plan.tp * sum(plan.shares)
    peak = sum(cluster.device(g).peak(plan.dtype) for g in range(plan.world_size))
    bubble = max(
        1.0 - r.run.busy_s / (len(r.run.ranks) * r.run.pipeline_time_s) for r in het.replicas
    )
    batch = plan.global_batch_size
    return RankedPlan(
        plan,
        worst.sizes,
        step,
        bubble,
        0.0,
        total_flops / (step * peak),
        batch * plan.seq_len / step,
        tuple(x.memory.total for x in worst.run.ranks),
        tuple(x.capacity_bytes for x in worst.run.ranks),
        hetero=het,
    )


def exact_of(plan: SimPlan, cluster: Cluster) -> Callable[..., RankedPlan | Rejection]:
    """Replicas alike: one replay. Unequal devices or unequal shares: one per replica,
    each pipeline cut and fed by its own devices, as training runs pipelines of their own
    (`plait.pipelines`). Options that runtime refuses (ZeRO, tp, compression, offload, two
    stages a rank...) on unequal devices are priced as the runtime runs them instead: one
    cut and equal shares for every replica, each replayed on its own devices."""
    if plan.total_microbatches:  # `plait.plan.space` proposes them with options it takes
        return exact_hetero
    if cluster.is_homogeneous or not runs_as_pipelines(plan):
        return exact
    return exact_hetero


def runs_as_pipelines(plan: SimPlan) -> bool:
    """Whether training can run `plan`'s replicas as pipelines of their own: options the
    runtime of pipelines takes (`plait.pipelines.hetero_refusal`), one stage a rank."""
    return plan.chunks == 1 and hetero_refusal(plan) is None


def _excess(err: ValueError) -> float:
    """How many bytes over memory a failed split was (0 for other errors)."""
    return err.excess_bytes if isinstance(err, MemoryShortfall) else 0.0
