"""`--plan auto`: profile the model on the real workers, plan its layout, agree on it.

The workers measure what the plan is predicted from (`plait.train.planinputs`: the link,
time-sharing, message posting, the sharded blocks, and rank 0 the blocks, one thread each
like each worker), rank 0 searches the layouts of the local workers with the planner, and
the plan is broadcast so every worker builds the same engine. Workers that outnumber the cores
time-share them, pinned as `plait.mesh.init_worker` pins them; the simulator shares each
core among the workers computing on it, at the efficiency the workers measure
(`plait.profile.sharing`). With `--cluster FILE` the workers are the file's devices as it
declares them instead (`local_cluster`), so plans of pipelines of different depths, which
the planner keeps from workers that share cores, are proposed for them.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from plait.cluster import Cluster
from plait.config import ParallelPlan
from plait.device import current
from plait.plan import ModelSpec, SearchSpace, search
from plait.plan.io import parallel_plan_of, plan_to_dict
from plait.train.planinputs import PlanInputs, measure_inputs, planning_view, profile_sizes

__all__ = [
    "auto_plan",
    "declared_cluster",
    "parallel_plan_from",
    "plan_samples",
    "preview_plan",
]


def parallel_plan_from(data: dict[str, Any]) -> ParallelPlan:
    """The engine's `ParallelPlan` from a plan file's dict (`plait plan --out`). The
    advice a hand-written layout gets (fewer micro-batches than stages idles some stages)
    is not repeated for a plan the planner chose knowing it: it predicted that cost."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return parallel_plan_of(data)  # every field (rank_order, ep); refuses `pipelines`


def plan_samples(task: Any, batch_size: int, world: int) -> list[tuple[Any, Any]]:
    """Micro-batches of step 0 at the sizes of `profile_sizes`, for the planner to learn how
    block costs grow with the micro-batch size."""
    inputs, targets = task.batch(0)
    return [(inputs[:b], targets[:b]) for b in profile_sizes(batch_size, world)]


def _search(
    spec: ModelSpec, cluster: Cluster, *, global_batch: int, dtype: str, allow_staleness: bool,
    device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    # a CPU worker's memory is the host's: moving state "to the host" frees none of it
    space = SearchSpace(dtype=dtype, allow_staleness=allow_staleness,
                        offload=device.type != "cpu")  # fmt: skip
    found = search(spec, cluster, global_batch=global_batch, space=space)
    return plan_to_dict(found.best, cluster=cluster.name)


def auto_plan(
    model: nn.Module,
    samples: list[tuple[Any, Any]],
    loss_fn: Any,
    *,
    num_heads: int,
    seq_len: int,
    global_batch: int,
    dtype: str = "fp32",
    allow_staleness: bool = False,
    device: torch.device | None = None,
    key: dict[str, Any] | None = None,
    replan: bool = False,
    declared: Cluster | None = None,
) -> dict[str, Any]:
    """The plan every worker trains under (call on every worker; a collective). `samples`
    are micro-batches of the sizes of `profile_sizes`, to learn how block costs grow with
    the size; rank 0 times the blocks on its `device` (default: the worker's) in the training
    `dtype`, while each other worker on a core or device of its own runs the same blocks
    (`workers_apart`), as they all do in training; every worker times a block sharded in
    its group of each tensor-parallel degree (`plait.profile.sharded`). `allow_staleness`
    lets the planner choose an asynchronous schedule. With a `key`
    (`plait.train.decisions.decision_key`), a decision kept under it is taken as it is,
    and a new one is kept, unless `replan`; the plan's `decision` says which.
    `declared` (`--cluster`): plan for the devices that file describes (`local_cluster`)."""
    from plait.train import decisions

    world = dist.get_world_size()
    device = device or current()
    box: list[Any] = [None]
    if dist.get_rank() == 0 and key is not None and not replan:
        box[0] = decisions.load(key)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        return dict(box[0])
    inputs = measure_inputs(model, samples, loss_fn, num_heads=num_heads, seq_len=seq_len,
                            device=device, dtype=dtype, declared=declared)  # fmt: skip
    if dist.get_rank() == 0:
        view = planning_view(model, samples, loss_fn, inputs, world, num_heads=num_heads,
                             seq_len=seq_len, dtype=dtype, device=device,
                             declared=declared)  # fmt: skip
        chosen = _search(*view, global_batch=global_batch, dtype=dtype,
                         allow_staleness=allow_staleness, device=device)  # fmt: skip
        chosen["decision"] = _why("measured", world, inputs)
        box[0] = decisions.save(key, chosen) if key is not None else chosen
    dist.broadcast_object_list(box, src=0)
    return dict(cast("dict[str, Any]", box[0]))  # mypy keeps box[0] as None from above


def preview_plan(cfg: Any, world: int) -> dict[str, Any]:
    """What `--plan auto` trains `cfg` (a TrainConfig) under on `world` local workers
    (`plait train --dry-run`): the decision kept for these flags on this host
    (`plait.train.decisions`), else one planned in this process and kept for the run.
    Planned here, the blocks are profiled on one thread as a worker would run them (on GPU
    0 on a GPU host, as rank 0 times them), and the collectives are the local-cpu preset's
    loopback figures, not measured among workers."""
    from plait.cluster import local_cpu
    from plait.device import device_name, resolve
    from plait.train import decisions
    from plait.train.task import task_from_config

    kind = resolve(cfg.device)
    device = torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")
    key = decisions.decision_key(cfg.to_dict(), world, device_name(device))
    kept = None if cfg.replan else decisions.load(key)
    if kept is not None:
        return kept
    task = task_from_config(cfg)
    link = local_cpu(devices=1).groups[0].intra_node
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        view = planning_view(task.model(), plan_samples(task, cfg.batch_size, world),
                             task.loss, PlanInputs(link), world, num_heads=task.num_heads,
                             seq_len=task.seq_len, dtype=cfg.parallel.dtype, device=device,
                             declared=declared_cluster(cfg, world))  # fmt: skip
        chosen = _search(*view, global_batch=cfg.batch_size, dtype=cfg.parallel.dtype,
                         allow_staleness=cfg.allow_staleness, device=device)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    chosen["decision"] = _why("previewed", world, PlanInputs(link))
    return decisions.save(key, chosen)


def _why(source: str, world: int, inputs: PlanInputs) -> dict[str, Any]:
    """What a decision was made from: who planned it, when, the link it assumed, the
    share of a core each worker keeps when they outnumber the cores and the seconds a
    CPU worker takes to post a message (1 and 0: each has a core or a GPU, or previewed
    in one process, which cannot measure them)."""
    return {"source": source, "measured_at": time.time(), "workers": world,
            **inputs.figures()}  # fmt: skip


def declared_cluster(cfg: Any, world: int) -> Cluster | None:
    """The cluster `cfg.cluster` names (`plait train --cluster`), checked against `world`
    workers, else None."""
    from plait.presets import load_cluster
    from plait.train.slowdown import check_cluster

    if not cfg.cluster:
        return None
    check_cluster(cfg.cluster, world)
    return load_cluster(cfg.cluster)
