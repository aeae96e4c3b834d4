"""`parallelize`: one model and one plan become this rank's `Engine`.

It checks every pass of `plait.train.passes` before touching the model, cuts the model
into this rank's pipeline stages, applies the passes in order (they shard, wrap, compile
and build the gradient sync and the optimizers) and hands the result to the engine. A plan
whose data-parallel replicas are pipelines of their own (HetPipe, WSP) is built by
`plait.train.hetero`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.blocks import block_names
from plait.config import ParallelPlan
from plait.device import current as current_device
from plait.keyed import agreed_seed, has_keyed_dropout
from plait.mesh import Meshes, build_mesh
from plait.parallel import expert_params
from plait.runtime import local_stages
from plait.runtime.channels import Channels, build_channels
from plait.schedule import Schedule, build
from plait.train.arguments import check_parallelize_arguments
from plait.train.engine import Engine, LossFn, OptimizerFactory, SchedulerFactory
from plait.train.passes import Build, Request, apply_passes, refusals
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
    if plan.pipelines is not None or plan.wsp_staleness is not None:  # pipelines of their own
        from plait.train.hetero import parallelize_hetero

        return parallelize_hetero(model, plan, optimizer_factory, loss_fn, device=device,
                                  grad_clip=grad_clip, timeout_s=timeout_s,
                                  scheduler_factory=scheduler_factory,
                                  compile=compile)  # fmt: skip
    request = Request(plan, compile=compile, mesh_given=mesh is not None)
    refused = refusals(request)
    if refused:
        raise ValueError("; ".join(refused))
    device = torch.device(device) if device is not None else current_device()
    meshes = (
        Meshes(main=mesh)
        if mesh is not None
        else build_mesh(plan.layout, device.type, experts=bool(expert_params(model)))
    )
    names = block_names(model)
    schedule = build(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
    channels = _channels(schedule, meshes.main)
    pp_rank = meshes.main.get_local_rank("pp")
    stages: dict[int, nn.Module] = dict(
        local_stages(model, schedule, pp_rank, sizes=plan.partition, device=device)
    )
    b = Build(request, meshes, schedule, stages, optimizer_factory, len(names), timeout_s,
              grad_clip)  # fmt: skip
    apply_passes(b)
    schedulers = (
        {s: scheduler_factory(o, max(1, schedule.updates_per_window))
         for s, o in b.optimizers.items()}
        if scheduler_factory is not None
        else None
    )  # fmt: skip
    return Engine(
        schedulers=schedulers,
        plan=plan,
        mesh=meshes.main,
        schedule=schedule,
        stages=stages,
        optimizers=b.optimizers,
        grad_sync=b.grad_sync,
        loss_fn=loss_fn,
        device=device,
        grad_clip=b.grad_clip,
        block_names=names,
        timeout_s=timeout_s,
        meshes=meshes,
        channels=channels,
        seed=agreed_seed(device) if has_keyed_dropout([model]) else 0,
    )


def _channels(schedule: Schedule, mesh: DeviceMesh) -> Channels | None:
    """Every pipeline's message channels (`plait.runtime.channels`), made on every rank
    in one order; this rank's. Each pipeline is the pp column of one (dp, tp) place."""
    if schedule.num_ranks == 1:
        return None
    names = mesh.mesh_dim_names or ()
    grid = mesh.mesh.movedim(names.index("pp"), 0).reshape(mesh["pp"].size(), -1)
    pipelines = [(schedule, [int(r) for r in grid[:, j]]) for j in range(grid.shape[1])]
    return build_channels(pipelines)
