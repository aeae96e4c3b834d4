"""`HeteroEngine`: the engine of one pipeline of a plan whose data-parallel replicas are
pipelines of their own depth, partition and micro-batch count (HetPipe's virtual workers,
Park et al., ATC 2020), synchronously or under Wave Synchronous Parallel.

`plait.train.parallelize` builds it as it builds every engine: this rank's pipeline is
placed as a plan of its own (`plait.train.placement`) and the same passes apply, with
three of their own that join the pipelines (`plait.train.passes`). What differs from a
homogeneous plan's engine is only how the pipelines meet:

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

from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.hetero import PipelineGroups
from plait.runtime import StepResult
from plait.train.batches import batch_size as _batch_size
from plait.train.batches import rows as _rows
from plait.train.engine import Engine, StepReport
from plait.train.wsp import WaveExchange

__all__ = ["HeteroEngine"]


class HeteroEngine(Engine):
    """The engine of one pipeline of a heterogeneous (or WSP) plan; `parallelize` builds
    it. `step` takes the global batch, like `Engine.step`. `groups`: where the pipelines
    meet; `waves`: WSP's exchange (None: synchronous)."""

    def __init__(
        self, *, groups: PipelineGroups, waves: WaveExchange | None, **engine: Any
    ) -> None:
        self.groups, self.waves = groups, waves
        # dropout draws by global micro-batch: the pipelines before this one take the first
        first = sum(groups.layout.microbatches[: groups.pipeline])
        super().__init__(first_microbatch=first, **engine)

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
