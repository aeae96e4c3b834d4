"""Plans whose pipelines differ in depth: HetPipe's virtual workers of unequal size (Park
et al., USENIX ATC 2020).

The (dp, pp) search gives every pipeline pp ranks. On a cluster of several device kinds
a slow kind may do better as one deep pipeline and a fast kind as shallow ones, or a kind
of small memory may need a depth the others do not. Here the cluster's ranks are grouped
into consecutive pipelines (`groupings`): each run of one device kind is cut into k equal
pipelines, for each k that divides it (one pipeline per kind, per node, or finer), and a
grouping takes one cut of each kind; groupings of one depth are left to the (dp, pp)
search. Each pipeline is cut by its own devices' speeds and memory (`split_replica` on
the cluster of its own ranks), the batch's micro-batches are shared by throughput
(`shares`), and each pipeline is replayed at its own depth with the gradient reduction
between pipelines (`plait.sim.depths`); the step is the slowest pipeline's.
A pipeline takes at least its share × its slowest stage's time: a grouping whose bound
is no better than the best step found so far is not replayed (the bounds of
`plait.plan.prune`, per pipeline).

Limits: what the runtime of pipelines takes (`plait.pipelines.check_hetero_plan`): tp = 1,
no ZeRO, experts, compression or offload, synchronous schedules of one stage a rank; a
pipeline never mixes device kinds. Devices that time-share processors (`--plan auto`'s
measured local workers when they outnumber the cores) are not planned so: each pipeline
is replayed on devices of its own, while pipelines sharing cores take each other's time;
a cluster file's devices are planned as it declares them (`plait.train.autoplan`).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Sequence
from dataclasses import replace

from plait.cluster import Cluster
from plait.config import PipelineSpec
from plait.cost import BlockCost, StageCost
from plait.pipelines import pipeline_layout
from plait.plan.exact import RankedPlan, Rejection, ranked_hetero
from plait.plan.hetero import HeteroPlan, Replica, shares, split_replica
from plait.plan.space import ModelSpec
from plait.sim import SimPlan, build_schedule
from plait.sim.depths import own_cluster, reduce_times, simulate_pipeline

__all__ = ["depth_plans", "groupings", "one_stage_a_rank", "simulate_pipelines", "template_of"]

# groupings priced per template: a handful, fewest pipelines first
MAX_GROUPINGS = 6


def groupings(cluster: Cluster, num_devices: int, max_depth: int) -> list[tuple[int, ...]]:
    """Depths of consecutive pipelines over the first `num_devices` ranks, of at least two
    depths and at most `max_depth` ranks each, fewest pipelines first."""
    runs: list[int] = []
    kind = None
    left = num_devices
    for group in cluster.groups:
        n = min(group.num_devices, left)
        left -= n
        if n and group.device == kind:
            runs[-1] += n
        elif n:
            runs.append(n)
        kind = group.device
    cuts = [[(n // k,) * k for k in range(1, n + 1) if n % k == 0 and n // k <= max_depth]
            for n in runs]  # fmt: skip
    found = {sum(c, ()) for c in itertools.product(*cuts)}
    mixed = [g for g in found if len(set(g)) > 1]
    return sorted(mixed, key=lambda g: (len(g), g))[:MAX_GROUPINGS]


def one_stage_a_rank(schedule: str) -> bool:
    """Whether `schedule` is synchronous and runs one stage on each rank (what pipelines of
    their own run)."""
    try:
        built = build_schedule(
            SimPlan(schedule=schedule, pp=2, microbatches=2), check=False, lowered=False
        )
    except ValueError:
        return False
    return built.policy == "sync" and built.reach == 0 and len(built.stage_to_rank) == 2


def template_of(plan: SimPlan) -> SimPlan:
    """What pipelines of their own keep of `plan`: its batch shape, dtype, recomputation and
    schedule (1F1B where the runtime of pipelines cannot run it)."""
    schedule = plan.schedule if one_stage_a_rank(plan.schedule) else "1f1b"
    recompute = plan.recompute if plan.recompute_stages is None else "full"
    return SimPlan(schedule=schedule, micro_batch_size=plan.micro_batch_size,
                   recompute=recompute, dtype=plan.dtype, optimizer=plan.optimizer,
                   seq_len=plan.seq_len, single_process=plan.single_process)  # fmt: skip


def _with_pipelines(template: SimPlan, specs: Sequence[PipelineSpec]) -> SimPlan:
    first = specs[0]
    with warnings.catch_warnings():  # fewer micro-batches than stages: priced, not warned
        warnings.simplefilter("ignore")
        return replace(template, dp=len(specs), pp=len(first.partition), partition=first.partition,
                       microbatches=first.microbatches, total_microbatches=0,
                       pipelines=tuple(specs))  # fmt: skip


def _alone(
    plan: SimPlan, depth: int, microbatches: int, partition: tuple[int, ...] | None
) -> SimPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return replace(plan, dp=1, pp=depth, microbatches=microbatches, partition=partition,
                       total_microbatches=0, pipelines=None)  # fmt: skip


def simulate_pipelines(plan: SimPlan, blocks: Sequence[BlockCost], cluster: Cluster) -> HeteroPlan:
    """Replay each of `plan.pipelines` at its own depth on its own consecutive ranks, with
    the reduction between pipelines (`plait.sim.depths`)."""
    assert plan.pipelines is not None
    sizes = [p.partition for p in plan.pipelines]
    layout = pipeline_layout(sizes, plan.shares, chunks=plan.chunks)
    replicas = []
    for i, spec in enumerate(plan.pipelines):
        ranks = layout.ranks[i]
        mine = _alone(plan, len(ranks), spec.microbatches, spec.partition)
        schedule = build_schedule(mine, check=False, lowered=False)
        if len(schedule.stage_to_rank) != len(spec.partition):
            raise ValueError(
                f"schedule={plan.schedule} runs {len(schedule.stage_to_rank)} stages on "
                f"{len(ranks)} ranks but pipeline {i} has partition={list(spec.partition)}"
            )
        bounds = [0, *itertools.accumulate(spec.partition)]
        stages = [StageCost(tuple(blocks[a:b])) for a, b in itertools.pairwise(bounds)]
        reduce_s = reduce_times(blocks, layout, i, cluster, mine)
        run = simulate_pipeline(schedule, stages, cluster, mine, ranks, reduce_s)
        slowest = max(r.compute_s + r.tp_comm_s for r in run.ranks) / spec.microbatches
        names = tuple(cluster.device(g).name for g in ranks)
        replicas.append(Replica(i, names, spec.partition, spec.microbatches, slowest, run))
    return HeteroPlan(plan, tuple(replicas))


def _price(
    template: SimPlan, depths: tuple[int, ...], model: ModelSpec, cluster: Cluster,
    total: int, best_s: float,
) -> RankedPlan | Rejection | None:  # fmt: skip
    """The plan of pipelines of `depths` sharing `total` micro-batches: ranked, rejected,
    or None when its bound is no better than `best_s`."""
    blocks = model.blocks_for(template)
    guess = max(1, total // len(depths))
    parts, first = [], 0
    for depth in depths:
        mine = _alone(template, depth, guess, None)
        sub = own_cluster(cluster, range(first, first + depth))
        try:
            parts.append(split_replica(mine, blocks, sub)[1])
        except ValueError as err:
            specs = [PipelineSpec(partition=(1,) * d, microbatches=guess) for d in depths]
            plan = _with_pipelines(template, specs)
            return Rejection(plan, f"pipeline of ranks {first}..{first + depth - 1}: {err}",
                             getattr(err, "excess_bytes", 0.0))  # fmt: skip
        first += depth
    counts = shares(total, [1.0 / p.bottleneck_s for p in parts])
    if max(m * p.bottleneck_s for m, p in zip(counts, parts, strict=True)) >= best_s:
        return None
    specs = [PipelineSpec(partition=tuple(p.sizes), microbatches=m)
             for p, m in zip(parts, counts, strict=True)]  # fmt: skip
    plan = _with_pipelines(template, specs)
    return ranked_hetero(plan, simulate_pipelines(plan, blocks, cluster), model, cluster)


def depth_plans(
    model: ModelSpec, cluster: Cluster, templates: Sequence[SimPlan], *, num_devices: int,
    global_batch: int, best_s: float = math.inf,
) -> tuple[list[RankedPlan | Rejection], int]:  # fmt: skip
    """Plans of pipelines of different depths over the first `num_devices` ranks, for each
    of `templates` (batch shape and options, `template_of`): (outcomes, plans replayed).
    Those whose bound is no better than the best step so far (`best_s`, then theirs) are
    skipped. Nothing for one kind of device, experts, or shared processors."""
    if cluster.is_homogeneous or cluster.shares_processors or model.num_experts:
        return [], 0
    out: list[RankedPlan | Rejection] = []
    replayed = 0
    for template in templates:
        if global_batch % template.micro_batch_size:
            continue
        total = global_batch // template.micro_batch_size
        for depths in groupings(cluster, num_devices, model.num_blocks):
            if total < len(depths):
                continue
            outcome = _price(template, depths, model, cluster, total, best_s)
            if outcome is None:
                continue
            replayed += isinstance(outcome, RankedPlan)
            if isinstance(outcome, RankedPlan):
                best_s = min(best_s, outcome.step_time_s)
            out.append(outcome)
    return out, replayed
