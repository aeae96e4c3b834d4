"""`parallelize`: one model, one plan, and an engine whose `step(batch)` trains under it.

The order of construction follows torchtitan's: cut the model into this rank's pipeline
stages, shard them for tensor parallelism, wrap blocks for recomputation, shard them
for ZeRO-2/3, then build the optimizer over what remains local. The engine owns nothing
the layers below do not already offer; it wires them together for one step:

    zero grads -> pipeline program (forward/backward per micro-batch, gradient reduction
    overlapped with each stage's last backward) -> fp16 unscale and global inf check ->
    global gradient-norm clipping -> optimizer step -> loss averaged over data parallel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.config import ParallelPlan
from plait.mesh import ParallelDims
from plait.parallel import (
    FSDPGradSync,
    GradReducer,
    apply_fsdp,
    apply_tensor_parallel,
    clip_grad_norm,
)
from plait.parallel.sync import GradSync
from plait.runtime import PipelineExecutor, StepResult, local_stages, split_microbatches
from plait.schedule import Schedule, build
from plait.train.precision import LossScaler, autocast_context
from plait.train.recompute import apply_recompute

__all__ = ["Engine", "StepReport", "parallelize"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepReport:
    """One training step, as every rank sees it."""

    loss: float  # mean loss over the global batch
    skipped: bool  # fp16 found an inf/NaN gradient somewhere and skipped the update
    grad_norm: float | None
    result: StepResult  # this rank's executor record (timeline, its micro-batch losses)


class Engine:
    """Trains this rank's share of a model under a `ParallelPlan`. Build with `parallelize`."""

    def __init__(
        self,
        *,
        plan: ParallelPlan,
        mesh: DeviceMesh,
        schedule: Schedule,
        stages: dict[int, nn.Module],
        executor: PipelineExecutor,
        optimizer: torch.optim.Optimizer,
        grad_sync: GradSync | None,
        device: torch.device,
        grad_clip: float | None,
    ) -> None:
        self.plan, self.mesh, self.schedule = plan, mesh, schedule
        self.stages, self.executor, self.optimizer = stages, executor, optimizer
        self.grad_sync, self.device, self.grad_clip = grad_sync, device, grad_clip
        self.params = [p for s in stages.values() for p in s.parameters() if p.requires_grad]
        self.scaler = LossScaler() if plan.dtype == "fp16" else None
        self.dp_index = mesh.get_local_rank("dp")
        self.needs_inputs = 0 in stages
        self.needs_targets = schedule.num_stages - 1 in stages

    def _shard(self, value: Any) -> Any:
        """This dp rank's slice of a global batch (dim 0)."""
        if self.plan.dp == 1:
            return value
        return split_microbatches(value, self.plan.dp)[self.dp_index]

    def step(self, batch: tuple[Any, Any]) -> StepReport:
        """One optimizer step on the global `batch` = (inputs, targets); every rank may pass
        the same batch; each dp rank trains on its own slice of dim 0."""
        inputs, targets = batch
        m = self.plan.microbatches
        micro_in = (
            split_microbatches(_to(self._shard(inputs), self.device), m)
            if self.needs_inputs
            else None
        )
        micro_tg = (
            split_microbatches(_to(self._shard(targets), self.device), m)
            if self.needs_targets
            else None
        )
        self.optimizer.zero_grad(set_to_none=True)
        if self.grad_sync is not None:  # after the optimizer: keeps bucket views alive
            self.grad_sync.zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        result = self.executor.step(micro_in, micro_tg, loss_scale=scale)
        if self.grad_sync is not None:
            self.grad_sync.finish()
        skipped = False
        if self.scaler is not None:
            skipped = self.scaler.unscale_and_check(self.params)
            self.scaler.update(skipped)
        norm = None
        if not skipped:
            if self.grad_clip is not None:
                norm = float(clip_grad_norm(self.params, self.grad_clip, pp_group=self._pp_group))
            self.optimizer.step()
        return StepReport(self._global_loss(result), skipped, norm, result)

    @property
    def _pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    def _global_loss(self, result: StepResult) -> float:
        """The full-batch loss on every rank: summed over pp (only the last stage has it),
        averaged over dp."""
        local = result.loss.detach().float() if result.loss is not None else None
        value = torch.zeros((), device=self.device) if local is None else local.to(self.device)
        value = value / self.plan.dp
        dist.all_reduce(value, group=self.mesh.get_group("pp"))
        if self.plan.dp > 1:
            dist.all_reduce(value, group=self.mesh.get_group("dp"))
        return float(value)


def _to(value: Any, device: torch.device) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _sync_replicas(stages: dict[int, nn.Module], mesh: DeviceMesh) -> None:
    """Make every dp replica start from dp rank 0's weights (and buffers)."""
    if mesh.size(mesh.mesh_dim_names.index("dp")) == 1:  # type: ignore[union-attr]
        return
    group = mesh.get_group("dp")
    src = dist.get_global_rank(group, 0)
    for stage in stages.values():
        for t in [*stage.parameters(), *stage.buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            dist.broadcast(local.data, src=src, group=group)


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    optimizer_factory: OptimizerFactory,
    loss_fn: LossFn,
    *,
    mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    grad_clip: float | None = None,
) -> Engine:
    """An `Engine` that trains `model` under `plan` on the current process group.

    Every rank passes the same model, initialised identically (same seed); the engine
    keeps only this rank's stages, sharded as the plan says. `optimizer_factory(params)`
    builds the optimizer over the local parameters (with ZeRO-1 it is wrapped in torch's
    ZeroRedundancyOptimizer so each dp rank keeps 1/dp of the optimizer state).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mesh = mesh or ParallelDims(dp=plan.dp, tp=plan.tp, pp=plan.pp).build_mesh(device.type)
    schedule = build(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
    pp_rank = mesh.get_local_rank("pp")
    stages: dict[int, nn.Module] = dict(
        local_stages(model, schedule, pp_rank, sizes=plan.partition, device=device)
    )
    for stage in stages.values():
        if plan.tp > 1:
            apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=plan.sequence_parallel)
        apply_recompute(stage, plan.recompute)
    _sync_replicas(stages, mesh)
    grad_sync: GradSync | None = None
    if plan.zero >= 2:
        sharded = {s: apply_fsdp(m, mesh["dp"], zero=plan.zero) for s, m in stages.items()}
        grad_sync = FSDPGradSync(sharded)
    elif plan.dp > 1:
        per_stage = {s: list(m.parameters()) for s, m in stages.items()}
        grad_sync = GradReducer(per_stage, mesh.get_group("dp"))
    params = [p for m in stages.values() for p in m.parameters() if p.requires_grad]
    optimizer = _optimizer(optimizer_factory, params, plan, mesh)
    executor = PipelineExecutor(
        schedule,
        stages,
        rank=pp_rank,
        loss_fn=loss_fn,
        group=mesh.get_group("pp"),
        device=device,
        grad_sync=grad_sync,
        forward_context=autocast_context(plan.dtype, device),
    )
    return Engine(
        plan=plan,
        mesh=mesh,
        schedule=schedule,
        stages=stages,
        executor=executor,
        optimizer=optimizer,
        grad_sync=grad_sync,
        device=device,
        grad_clip=grad_clip,
    )


def _optimizer(
    factory: OptimizerFactory, params: list[nn.Parameter], plan: ParallelPlan, mesh: DeviceMesh
) -> torch.optim.Optimizer:
    optimizer = factory(params)
    if plan.zero != 1 or plan.dp == 1:
        return optimizer
    if plan.tp > 1:
        raise ValueError(
            "zero=1 with tp > 1 is not supported (torch's ZeroRedundancyOptimizer takes plain "
            "tensors): use zero=2 or zero=3, which shard optimizer state too, or tp=1"
        )
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    # `defaults` may hold entries the constructor does not take (AdamW's
    # decoupled_weight_decay): pass on only the constructor's own arguments
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(
        params,
        optimizer_class=type(optimizer),
        process_group=mesh.get_group("dp"),
        **settings,
    )
