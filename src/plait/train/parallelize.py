"""`parallelize`: one model and one plan become this rank's `Engine`.

It checks every pass of `plait.train.passes` before touching the model, places this rank's
pipeline (`plait.train.placement`: its mesh, schedule, channels and stage cut, for a plan
of one grid of ranks or one whose data-parallel replicas are pipelines of their own, as
HetPipe's and WSP's are), cuts the model into this rank's stages, applies the passes in
order (they shard, wrap, compile, join the replicas and build the gradient sync and the
optimizers) and hands the result to the engine (`plait.train.hetero.HeteroEngine` for
pipelines of their own, which cuts their shares of the batch and reports their loss).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.blocks import block_names
from plait.config import ParallelPlan
from plait.device import current as current_device
from plait.keyed import agreed_seed, has_keyed_dropout
from plait.parallel import expert_params
from plait.runtime import local_stages
from plait.train.arguments import check_parallelize_arguments
from plait.train.engine import Engine, LossFn, OptimizerFactory, SchedulerFactory
from plait.train.hetero import HeteroEngine
from plait.train.passes import Build, Request, apply_passes, refusals
from plait.train.placement import rank_pipeline
from plait.wait import DEFAULT_TIMEOUT_S

__all__ = ["parallelize"]


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    optimizer_factory: OptimizerFactory,
    loss_fn: LossFn,
    *,
    mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    grad_clip: float | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    scheduler_factory: SchedulerFactory | None = None,
    compile: bool = False,
) -> Engine:
    """An `Engine` that trains `model` under `plan` on the current process group.

    Every rank passes the same model, initialised identically (same seed); the engine
    keeps only this rank's stages, sharded as the plan says. `optimizer_factory(params)`
    builds an optimizer over one stage's local parameters (with ZeRO-1 it is wrapped in
    torch's ZeroRedundancyOptimizer so each dp rank keeps 1/dp of the optimizer state).
    A wait for a peer's message or reduction longer than `timeout_s` seconds raises
    `plait.runtime.transport.PipelineTimeout` naming the action and the peer (None: wait
    as long as the process group's timeout; see that module). `scheduler_factory(optimizer,
    updates_per_window)` builds each stage's learning-rate schedule, stepped once per
    update of that stage (an asynchronous schedule makes several updates per window).
    `compile` torch.compiles each block after recomputation (`plait.train.compile`).
    """
    check_parallelize_arguments(model, plan, optimizer_factory, loss_fn)
    request = Request(plan, compile=compile, mesh_given=mesh is not None)
    refused = refusals(request)
    if refused:
        raise ValueError("; ".join(refused))
    device = torch.device(device) if device is not None else current_device()
    names = block_names(model)
    mine = rank_pipeline(plan, num_blocks=len(names), device_type=device.type, mesh=mesh,
                         experts=bool(expert_params(model)))  # fmt: skip
    stages: dict[int, nn.Module] = dict(
        local_stages(model, mine.schedule, mine.pp_rank, sizes=mine.sizes, device=device)
    )
    if mine.groups is not None:  # the passes see this rank's pipeline as a plan of its own
        request = Request(mine.plan, compile=compile, whole=plan)
    b = Build(request, mine.meshes, mine.schedule, stages, optimizer_factory, len(names),
              timeout_s, grad_clip, groups=mine.groups)  # fmt: skip
    apply_passes(b)
    schedulers = (
        {s: scheduler_factory(o, max(1, mine.schedule.updates_per_window))
         for s, o in b.optimizers.items()}
        if scheduler_factory is not None
        else None
    )  # fmt: skip
    common: dict[str, Any] = dict(
        schedulers=schedulers,
        plan=mine.plan,
        mesh=mine.meshes.main,
        schedule=mine.schedule,
        stages=stages,
        optimizers=b.optimizers,
        grad_sync=b.grad_sync,
        loss_fn=loss_fn,
        device=device,
        grad_clip=b.grad_clip,
        block_names=names,
        timeout_s=timeout_s,
        meshes=mine.meshes,
        channels=mine.channels,
        seed=agreed_seed(device) if has_keyed_dropout([model]) else 0,
    )
    if mine.groups is not None:
        return HeteroEngine(groups=mine.groups, waves=b.waves, **common)
    return Engine(**common)
