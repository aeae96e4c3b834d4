"""`--plan auto`: profile the model on the real workers, plan its layout, agree on it.

Rank 0 measures every block on one micro-batch (one thread, like each worker) while the
others wait, then searches the layouts of the local workers with the planner; the plan
is broadcast so every worker builds the same engine. Workers that outnumber the cores
time-share them, pinned as `plait.mesh.init_worker` pins them; the simulator shares each
core among the workers computing on it, at the efficiency the workers measure
(`plait.profile.sharing`). With `--cluster FILE` the workers are the file's devices as it
declares them instead (`local_cluster`), so plans of pipelines of different depths, which
the planner keeps from workers that share cores, are proposed for them.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from plait.blocks import as_blocks
from plait.cluster import Cluster, Link, measured_cluster
from plait.config import ParallelPlan
from plait.device import current, fork_rng, timer
from plait.mesh import host_cores
from plait.plan import ModelSpec, SearchSpace, scaled_spec, search
from plait.plan.io import parallel_plan_of, plan_to_dict
from plait.profile import block_costs, measured_device, profile_model
from plait.profile.calibrate import fit_link, posting_s
from plait.profile.sharded import TPRatios, tp_degrees, tp_ratios
from plait.profile.sharing import measure_sharing_efficiency

__all__ = [
    "auto_plan",
    "boundary_bytes",
    "declared_cluster",
    "local_cluster",
    "measure_collectives",
    "measured_spec",
    "parallel_plan_from",
    "plan_samples",
    "preview_plan",
    "profile_sizes",
    "workers_apart",
]


_REDUCED = (256, 64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # bytes all-reduced


def measure_collectives(device: torch.device | None = None, *, repeats: int = 8) -> Link:
    """The link that reproduces the all-reduce times the workers measure among themselves
    (a collective: call on every worker), as the cost model's ring formula reads it:
    t(bytes) = 2(n-1)·latency + 2(n-1)/n · bytes / bandwidth. Measured on the workers'
    `device` (default: `plait.device.current`, so NCCL between GPUs) while every worker
    takes part, so it includes the backend's and Python's per-call costs and core sharing.
    The sizes take turns, so that a slow spell of a shared host falls on all of them, and
    the line is fitted to the median of each (`_ring_link`)."""
    import statistics

    n = dist.get_world_size()
    if n == 1:  # nothing to reduce among: any link; the cost model charges none at n=1
        return Link(latency_s=1e-6, bandwidth_Bps=1e9)
    device = device or current()
    now = timer(device)
    buffers = [torch.zeros(size // 4, device=device) for size in _REDUCED]
    times: list[list[float]] = [[] for _ in _REDUCED]
    for _ in range(repeats):
        for buffer, seen in zip(buffers, times, strict=True):
            dist.barrier()
            start = now()
            dist.all_reduce(buffer)
            seen.append(now() - start)
    return _ring_link(
        [(float(b), statistics.median(t)) for b, t in zip(_REDUCED, times, strict=True)], n
    )


def _ring_link(samples: list[tuple[float, float]], n: int) -> Link:
    """The link under which the ring formula of `measure_collectives` gives these (bytes,
    seconds) all-reduce times among `n` ranks: the line `fit_link` fits to them, read as
    2(n-1) latencies and 2(n-1)/n of the bytes moved."""
    line = fit_link(samples)
    steps = 2 * (n - 1)
    return Link(
        latency_s=max(line.latency_s / steps, 1e-6), bandwidth_Bps=steps / n * line.bandwidth_Bps
    )


def boundary_bytes(model: nn.Module, sample: tuple[Any, Any]) -> int:
    """Bytes of what the model's first block hands the next for `sample`'s inputs: the
    size of a pipeline boundary's message at that batch."""
    with torch.no_grad():
        out = as_blocks(model)[0](sample[0])
    leaves = out if isinstance(out, tuple | list) else (out,)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def parallel_plan_from(data: dict[str, Any]) -> ParallelPlan:
    """The engine's `ParallelPlan` from a plan file's dict (`plait plan --out`). The
    advice a hand-written layout gets (fewer micro-batches than stages idles some stages)
    is not repeated for a plan the planner chose knowing it: it predicted that cost."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return parallel_plan_of(data)  # every field (rank_order, ep); refuses `pipelines`


_SPEED = 1e9  # any rate: measured seconds become FLOPs at it and back


def measured_spec(
    model: nn.Module,
    samples: list[tuple[Any, Any]],
    loss_fn: Any,
    *,
    num_heads: int,
    seq_len: int,
    dtype: str = "fp32",
    device: torch.device | None = None,
    tp_ratios: TPRatios | None = None,
) -> ModelSpec:
    """The planner's view of `model` from its blocks measured here on `device` (default:
    where they are) in the training `dtype` (its autocast), at each sample's micro-batch
    size, with the full and the split backward; with `tp_ratios`
    (`plait.profile.sharded.tp_ratios`), its sharded blocks cost what they were measured
    to cost sharded."""
    rate = measured_device(name="measured", flops=_SPEED, dtype=dtype, memory_bytes=2**34)
    full, split = {}, {}
    for x, y in samples:
        # measured afresh: a cached profile may have been taken under other load
        profile = profile_model(model, x, target=y, loss_fn=loss_fn, repeats=5, cache=False,
                                device=device, dtype=dtype)  # fmt: skip
        full[int(x.shape[0])] = block_costs(profile.blocks, rate, dtype)
        split[int(x.shape[0])] = block_costs(profile.blocks, rate, dtype, split=True)
    sharded = [i for i, b in enumerate(as_blocks(model)) if hasattr(b, "tp_plan")]
    # with no block that shards, tensor parallelism is out: tp must divide 1
    return scaled_spec("model", full, seq_len=seq_len, num_heads=num_heads if sharded else 1,
                       tp_blocks=sharded, measured_split=split, tp_ratios=tp_ratios)  # fmt: skip


def local_cluster(
    world: int,
    link: Link,
    dtype: str = "fp32",
    *,
    cores: int | None = None,
    sharing_efficiency: float = 1.0,
    device: str = "cpu",
    declared: Cluster | None = None,
    message_s: float = 0.0,
) -> Cluster:
    """The local workers on `device` (a device type) as the planner sees them: a GPU each,
    or one core each, or, when they outnumber the `cores` (default: those the workers were
    started on, `plait.mesh.host_cores`, not a pinned worker's own), pinned to core i mod
    cores as `plait.mesh.init_worker` pins them and time-sharing it
    (`NodeGroup.processors`). `message_s`: the seconds a worker's computing thread takes
    to post a pipeline message (`plait.profile.calibrate.posting_s`). With `declared` (the
    `--cluster` file), rank r is that file's device r instead (`_declared`)."""
    from plait.train.memcheck import worker_memory_bytes

    memory = int(worker_memory_bytes(world, device))
    cores = world if device != "cpu" else cores or host_cores()
    cluster = measured_cluster(
        name=f"local-workers ({device})", flops={dtype: _SPEED}, memory_bytes=memory,
        devices_per_node=world, intra_node=link,
    )  # fmt: skip
    if declared is not None:
        return _declared(cluster, declared, world)
    group = cluster.groups[0]
    group = replace(group, device=replace(group.device, message_s=message_s))
    if world > cores:
        group = replace(group, processors=cores, sharing_efficiency=sharing_efficiency)
    return replace(cluster, groups=(group,))


def _declared(measured: Cluster, declared: Cluster, world: int) -> Cluster:
    """The `world` workers as `declared` says they are: rank r is its device r, with that
    device's name, `slowdown` (which `plait.train.slowdown` runs), memory (at most a
    worker's share here) and node, computing at the measured rate over the measured link.
    A cluster file is the user's statement of the hardware: its devices compute on their
    own unless its nodes say they share processors, however many cores this host has
    (the time-sharing of cores that `local_cluster` models is this host's, measured)."""
    base = measured.groups[0]
    runs: list[tuple[tuple[int, object], int]] = []
    for rank in range(world):
        key = (declared.node_of(rank), declared.device(rank))
        if runs and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1] + 1)
        else:
            runs.append((key, 1))
    groups, first = [], 0
    for _, size in runs:
        mine = declared.device(first)
        device = replace(base.device, name=mine.name, slowdown=mine.slowdown,
                         memory_bytes=min(base.device.memory_bytes, mine.memory_bytes))  # fmt: skip
        shared = len({declared.processor(r) for r in range(first, first + size)})
        groups.append(replace(base, device=device, devices_per_node=size,
                              processors=shared if shared < size else None,
                              sharing_efficiency=declared.sharing_efficiency(first)))  # fmt: skip
        first += size
    return replace(measured, name=declared.name, groups=tuple(groups), inter_node=base.intra_node)


def workers_apart(world: int, device: torch.device) -> int:
    """How many workers run on cores (or devices) of their own: those profile the blocks
    at once. On a 2-core host a GPT's forward and backward took 17-19% longer
    (median of 35) beside a second process doing the same on the other core (shared caches
    and memory bandwidth), as every worker is in training, than alone, as rank 0 alone had
    timed it: the planner's predictions on CPU workers came out that much low."""
    return world if device.type != "cpu" else min(world, host_cores())


def profile_sizes(batch_size: int, world: int, largest: int | None = None) -> list[int]:
    """The micro-batch sizes the planner measures blocks at: one sample, a worker's whole
    share, and the largest micro-batch a plan may take (default: the largest size of the
    search space that divides the batch). A block's time between two of them is read off
    the line through them; past the last it would be a guess, and a block's time bends
    (on a 2-core host, the planner sweep's tensor-parallel plans of 8-sample micro-batches,
    priced from blocks measured at 1 and 4, came out 22-53% over their measured steps)."""
    if largest is None:
        largest = max((b for b in SearchSpace().micro_batch_sizes if batch_size % b == 0),
                      default=1)  # fmt: skip
    return sorted({1, max(1, batch_size // world), max(1, min(largest, batch_size))})


def plan_samples(task: Any, batch_size: int, world: int) -> list[tuple[Any, Any]]:
    """Micro-batches of step 0 at the sizes of `profile_sizes`, for the planner to learn how
    block costs grow with the micro-batch size."""
    inputs, targets = task.batch(0)
    return [(inputs[:b], targets[:b]) for b in profile_sizes(batch_size, world)]


def _search(
    model: nn.Module,
    samples: list[tuple[Any, Any]],
    loss_fn: Any,
    link: Link,
    world: int,
    *,
    num_heads: int,
    seq_len: int,
    global_batch: int,
    dtype: str,
    allow_staleness: bool,
    device: torch.device,
    declared: Cluster | None = None,
    tp_ratios: TPRatios | None = None,
    sharing: float = 1.0,
    message_s: float = 0.0,
) -> dict[str, Any]:
    with fork_rng(device):
        spec = measured_spec(model, samples, loss_fn, num_heads=num_heads, seq_len=seq_len,
                             dtype=dtype, device=device, tp_ratios=tp_ratios)  # fmt: skip
    cluster = local_cluster(world, link, dtype, device=device.type, declared=declared,
                            sharing_efficiency=sharing, message_s=message_s)  # fmt: skip
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
    link = measure_collectives(device)
    apart = workers_apart(world, device)
    share = samples[len(samples) // 2]  # a worker's share of the batch (`profile_sizes`)
    # CPU workers post messages on the thread that computes; NCCL's posting is asynchronous
    posting = posting_s(boundary_bytes(model, share)) if device.type == "cpu" else 0.0
    # a declared cluster's devices are planned as the file says, one each: none shared
    cores = apart if declared is None else world
    with fork_rng(device):  # workers outnumbering the cores: what each keeps of one
        sharing = measure_sharing_efficiency(model, share, loss_fn, cores=cores)
    with fork_rng(device):  # every worker: the sharded blocks are timed in their groups
        ratios = tp_ratios(model, samples, degrees=tp_degrees(world, num_heads),
                           sequence_parallel=(False, True), dtype=dtype, device=device,
                           cores=cores, sharing_efficiency=sharing)  # fmt: skip
    rank = dist.get_rank()
    if 0 < rank < apart:  # loads its core as in training while 0 times
        with fork_rng(device):
            measured_spec(model, samples, loss_fn, num_heads=num_heads, seq_len=seq_len,
                          dtype=dtype, device=device)  # fmt: skip
    if rank == 0:
        chosen = _search(model, samples, loss_fn, link, world, num_heads=num_heads,
                         seq_len=seq_len, global_batch=global_batch, dtype=dtype,
                         allow_staleness=allow_staleness, device=device,
                         declared=declared, tp_ratios=ratios, sharing=sharing,
                         message_s=posting)  # fmt: skip
        chosen["decision"] = _why("measured", world, link, sharing, posting)
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
        chosen = _search(task.model(), plan_samples(task, cfg.batch_size, world), task.loss,
                         link, world, num_heads=task.num_heads, seq_len=task.seq_len,
                         global_batch=cfg.batch_size, dtype=cfg.parallel.dtype,
                         allow_staleness=cfg.allow_staleness, device=device,
                         declared=declared_cluster(cfg, world))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    chosen["decision"] = _why("previewed", world, link)
    return decisions.save(key, chosen)


def _why(
    source: str, world: int, link: Link, sharing: float = 1.0, message_s: float = 0.0
) -> dict[str, Any]:
    """What a decision was made from: who planned it, when, the link it assumed, the
    share of a core each worker keeps when they outnumber the cores and the seconds a
    CPU worker takes to post a message (1 and 0: each has a core or a GPU, or previewed
    in one process, which cannot measure them)."""
    return {
        "source": source, "measured_at": time.time(), "workers": world,
        "link": {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps},
        "sharing_efficiency": sharing, "message_s": message_s,
    }  # fmt: skip


def declared_cluster(cfg: Any, world: int) -> Cluster | None:
    """The cluster `cfg.cluster` names (`plait train --cluster`), checked against `world`
    workers, else None."""
    from plait.presets import load_cluster
    from plait.train.slowdown import check_cluster

    if not cfg.cluster:
        return None
    check_cluster(cfg.cluster, world)
    return load_cluster(cfg.cluster)
