"""`parallelize_hetero`: training a plan whose data-parallel replicas are pipelines of their
own depth, partition and micro-batch count (HetPipe's virtual workers, Park et al., ATC
2020), synchronously or under Wave Synchronous Parallel.

Each pipeline runs the ordinary engine (`plait.train.engine.Engine`) over its own ranks,
its own schedule and its own stage cut; what differs from a homogeneous plan is only how
the pipelines meet:

- the batch: pipeline i takes its share B_i = m_i · b of the global batch of B samples
  (b = B / Σ m_j samples per micro-batch), rows in pipeline order;
- synchronous (`wsp_staleness` unset): gradients are reduced per block group, weighted by
  B_i / B (`plait.parallel.hetero.ShareReducer`), so a step equals one process on the
  whole batch; clipping and the inf check run over the pipeline's ranks, which hold the
  whole (already reduced) gradient;
- WSP (`wsp_staleness` = D): no gradient reduction; each pipeline steps its own optimizer
  and the wave exchange (`plait.train.wsp`) adds the others' updates D waves late.

A homogeneous plan with `wsp_staleness` runs here too: dp pipelines of pp ranks each,
all cut alike (stale-synchronous data parallelism when pp = 1).

Limits: tp = 1, no ZeRO, no experts, no gradient compression, synchronous schedules
(`plait.pipelines.check_hetero_plan` refuses the rest); the reported loss of a WSP step is
the pipeline's own (pipelines train on different weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.blocks import block_names
from plait.config import ParallelPlan
from plait.device import current as current_device
from plait.keyed import StepDraws, agreed_seed
from plait.mesh import pipeline_mesh
from plait.parallel.hetero import BlockBuckets, PipelineGroups, ShareReducer, pipeline_groups
from plait.pipelines import PipelineLayout, pipeline_layout
from plait.runtime import StepResult, local_stages
from plait.runtime.channels import build_channels
from plait.schedule import build
from plait.train.batches import batch_size as _batch_size
from plait.train.batches import rows as _rows
from plait.train.compile import apply_compile
from plait.train.engine import (
    Engine,
    LossFn,
    OptimizerFactory,
    SchedulerFactory,
    StepReport,
)
from plait.train.recompute import apply_recompute
from plait.train.wsp import WaveExchange
from plait.wait import DEFAULT_TIMEOUT_S

__all__ = ["HeteroEngine", "layout_of", "parallelize_hetero"]


def layout_of(plan: ParallelPlan, num_blocks: int | None = None) -> PipelineLayout:
    """The pipelines of `plan`: its `pipelines`, or dp alike ones (`partition`, or an equal
    split of `num_blocks`)."""
    if plan.pipelines is not None:
        sizes = [p.partition for p in plan.pipelines]
        counts = [p.microbatches for p in plan.pipelines]
        return pipeline_layout(sizes, counts, chunks=plan.chunks, rank_order=plan.rank_order)
    if plan.partition is not None:
        part: tuple[int, ...] = plan.partition
    else:
        if num_blocks is None:
            raise ValueError("an equal split needs the number of blocks")
        stages = plan.num_stages
        part = tuple(num_blocks // stages + (s < num_blocks % stages) for s in range(stages))
    return pipeline_layout(
        [part] * plan.dp, [plan.microbatches] * plan.dp, chunks=plan.chunks,
        rank_order=plan.rank_order,
    )  # fmt: skip


class HeteroEngine(Engine):
    """The engine of one pipeline of a heterogeneous (or WSP) plan; build it with
    `parallelize_hetero`. `step` takes the global batch, like `Engine.step`."""

    groups: PipelineGroups
    waves: WaveExchange | None

    def step(self, batch: tuple[Any, Any], *, index: int | None = None) -> StepReport:
        if self.waves is not None:
            self.waves.before_step()
        report = super().step(batch, index=index)
        if self.waves is not None:
            self.waves.after_step()
        return report

    def finish(self) -> None:
        """WSP: push the last (partial) wave and take in every pushed wave, so that every
        pipeline holds the global weights. Nothing to do when synchronous."""
        if self.waves is not None:
            self.waves.finish()

    def drain(self) -> StepReport:
        """After the last step: `finish`, then the engine's drain."""
        self.finish()
        return super().drain()

    def run(self, microbatches: Any) -> Any:
        raise NotImplementedError("a heterogeneous plan trains by step(batch), not a stream")

    def _shard(self, value: Any) -> Any:
        """This pipeline's rows of the global batch (see the module docstring)."""
        layout, i = self.groups.layout, self.groups.pipeline
        total = sum(layout.microbatches)
        size = _batch_size(value)
        if size % total:
            raise ValueError(
                f"batch of {size} samples cannot be cut into the plan's {total} micro-batches "
                f"({list(layout.microbatches)} per pipeline): use a multiple of {total}"
            )
        each = size // total
        first = sum(layout.microbatches[:i]) * each
        return _rows(value, first, layout.microbatches[i] * each)

    def _report(self, result: StepResult, *, last: bool = False) -> StepReport:
        if last:  # a drain: a synchronous pipeline has nothing left to report
            return StepReport(float("nan"), False, None, result, (), (), result.updates)
        loss, *flags = self._loss(result)
        skipped, norm = self._settle(flags)
        # one loss per micro-batch of this pipeline's step (ids as the logs count them)
        m = self.schedule.num_microbatches
        ids = tuple(range((self.executor.windows - 1) * m, self.executor.windows * m))
        return StepReport(loss, skipped, norm, result, (loss,) * m, ids, result.updates)

    def _loss(self, result: StepResult) -> list[float]:
        """Synchronous: the batch's mean loss, Σ_i share_i · mean_i, from every pipeline's
        last stage. WSP: the pipeline's own (pipelines train on different weights), from
        its last stage, without waiting for the other pipelines. Then the values of the
        engine's `_flags`, read in the same copy."""
        value = torch.zeros(1, device=self.device)
        if result.losses:
            value += torch.stack([x.detach().float() for x in result.losses]).mean()
        layout, i = self.groups.layout, self.groups.pipeline
        if self.waves is None:
            dist.all_reduce(value.mul_(layout.batch_shares()[i]))
        else:
            owner = (self.schedule.num_stages - 1) % len(layout.ranks[i])
            src = dist.get_global_rank(self.groups.pp_group, owner)
            dist.broadcast(value, src=src, group=self.groups.pp_group)
        flags = [t.reshape(1).to(value.device, torch.float32) for t in self._flags()]
        return torch.cat([value, *flags]).tolist()


def parallelize_hetero(
    model: nn.Module,
    plan: ParallelPlan,
    optimizer_factory: OptimizerFactory,
    loss_fn: LossFn,
    *,
    device: torch.device | str | None = None,
    grad_clip: float | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    scheduler_factory: SchedulerFactory | None = None,
    compile: bool = False,
) -> HeteroEngine:
    """A `HeteroEngine` for this rank's pipeline of `plan` (see the module docstring).
    Every rank passes the same model, initialised identically."""
    device = torch.device(device) if device is not None else current_device()
    names = block_names(model)
    layout = layout_of(plan, len(names))
    groups = pipeline_groups(layout)
    i = groups.pipeline
    pp = len(layout.ranks[i])
    mine = dataclasses.replace(
        plan, dp=1, dp_replicate=None, dp_shard=None, pp=pp, partition=layout.sizes[i],
        microbatches=layout.microbatches[i],
        pipelines=None, wsp_staleness=None, wsp_at_most=False,
    )  # fmt: skip
    schedule = build(plan.schedule, pp, mine.microbatches, plan.chunks)
    channels = build_channels([
        (build(plan.schedule, len(ranks), count, plan.chunks), ranks)
        for ranks, count in zip(layout.ranks, layout.microbatches, strict=True)
    ])  # fmt: skip
    stages: dict[int, nn.Module] = dict(
        local_stages(model, schedule, groups.pp_rank, sizes=layout.sizes[i], device=device)
    )
    for index, stage in stages.items():
        apply_recompute(stage, plan.recompute_of(index))
        if compile:
            apply_compile(stage)
    buckets = BlockBuckets(groups, stages)
    _same_start(buckets)
    synchronous = plan.wsp_staleness is None
    share = layout.batch_shares()[i]
    optimizers = {
        s: optimizer_factory([p for p in m.parameters() if p.requires_grad])
        for s, m in stages.items()
    }
    schedulers = (
        {s: scheduler_factory(o, 1) for s, o in optimizers.items()}
        if scheduler_factory is not None
        else None
    )
    engine = HeteroEngine(
        plan=mine, schedule=schedule,
        mesh=pipeline_mesh(mine.layout, layout.ranks[i], groups.pp_group, device.type),
        stages=stages, optimizers=optimizers,
        grad_sync=ShareReducer(buckets, share) if synchronous else None, loss_fn=loss_fn,
        device=device, grad_clip=grad_clip, block_names=names, timeout_s=timeout_s,
        schedulers=schedulers, channels=channels,
    )  # fmt: skip
    engine.groups = groups
    if engine.executor.backend.draw is not None:  # keyed dropout: this pipeline's rows
        engine.draws = StepDraws(agreed_seed(device), layout.microbatches[i],
                                 sum(layout.microbatches[:i]))  # fmt: skip
        engine.executor.backend.draw = engine.draws
    staleness, at_most = int(plan.wsp_staleness or 0), plan.wsp_at_most
    engine.waves = (
        None
        if synchronous
        else WaveExchange(buckets, staleness=staleness, wave=plan.wsp_wave, at_most=at_most)
    )
    return engine


def _same_start(buckets: BlockBuckets) -> None:
    """Every pipeline starts from pipeline 0's weights (the lowest rank of each group)."""
    for index, (group, holders, _) in enumerate(buckets.buckets):
        flat = buckets.flat(index)
        dist.broadcast(flat, src=min(holders), group=group)
        buckets.copy_in(index, flat)
