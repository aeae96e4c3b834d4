"""What `--plan auto` plans from, measured on the workers themselves: the link among them
(`measure_collectives`), how well they time-share a core when they outnumber the cores
(`plait.profile.sharing`), what posting a pipeline message takes a CPU worker's computing
thread (`plait.profile.calibrate.posting_s`), the sharded blocks' costs
(`plait.profile.sharded`) and the blocks themselves (`measured_spec`, rank 0 while the
workers on cores of their own run them too, as in training). `measure_inputs` takes them
in that order, `planning_view` turns them into the planner's model and cluster; the
planner sweep (`plait bench planner`) calls the same two, so it predicts from what
`--plan auto` measures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.blocks import as_blocks
from plait.cluster import Cluster, Link, measured_cluster
from plait.device import current, fork_rng, timer
from plait.mesh import host_cores, kept_keys, release_kept
from plait.plan import ModelSpec, SearchSpace, scaled_spec
from plait.profile import block_costs, measured_device, profile_model
from plait.profile.calibrate import fit_link, posting_s
from plait.profile.sharded import TPRatios, tp_degrees, tp_ratios
from plait.profile.sharing import measure_sharing_efficiency

__all__ = [
    "PlanInputs",
    "boundary_bytes",
    "local_cluster",
    "measure_collectives",
    "measure_inputs",
    "measured_spec",
    "planning_view",
    "profile_sizes",
    "profiled_seconds",
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


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is predicted from beside the blocks, measured among the workers by
    `measure_inputs`: the link, the share of a core each worker keeps while they outnumber
    the cores, the seconds a CPU worker's computing thread takes to post a pipeline
    message, and this rank's sharded blocks' costs (`plait.profile.sharded`)."""

    link: Link
    sharing: float = 1.0
    message_s: float = 0.0
    tp_ratios: TPRatios | None = None

    def figures(self) -> dict[str, Any]:
        """The measured figures as `plan.json`'s decision and the planner sweep report them."""
        return {
            "link": {"latency_s": self.link.latency_s, "bandwidth_Bps": self.link.bandwidth_Bps},
            "sharing_efficiency": self.sharing,
            "message_s": self.message_s,
        }


def measure_inputs(
    model: nn.Module,
    samples: list[tuple[Any, Any]],
    loss_fn: Any,
    *,
    num_heads: int,
    seq_len: int,
    device: torch.device | None = None,
    dtype: str = "fp32",
    declared: Cluster | None = None,
    sequence_parallel: tuple[bool, ...] = (False, True),
) -> PlanInputs:
    """Measure among the workers what `--plan auto` (and the planner sweep) plans from
    (collective; each rank gets its own `PlanInputs`). `samples` as `auto_plan` takes
    them. On return, each worker on a core of its own other than rank 0 has just run the
    blocks again (`workers_apart`), while rank 0 profiled them (`planning_view`, called
    next on rank 0 alone): timed beside as many computing workers as in training."""
    world = dist.get_world_size()
    device = device or current()
    link = measure_collectives(device)
    apart = workers_apart(world, device)
    share = samples[len(samples) // 2]  # a worker's share of the batch (`profile_sizes`)
    # CPU workers post messages on the thread that computes; NCCL's posting is asynchronous
    posting = posting_s(boundary_bytes(model, share)) if device.type == "cpu" else 0.0
    # a declared cluster's devices are planned as the file says, one each: none shared
    cores = apart if declared is None else world
    with fork_rng(device):  # workers outnumbering the cores: what each keeps of one
        sharing = measure_sharing_efficiency(model, share, loss_fn, cores=cores)
    before = kept_keys()
    with fork_rng(device):  # every worker: the sharded blocks are timed in their groups
        ratios = tp_ratios(model, samples, degrees=tp_degrees(world, num_heads),
                           sequence_parallel=sequence_parallel, dtype=dtype, device=device,
                           cores=cores, sharing_efficiency=sharing)  # fmt: skip
    # the groups made to time them, gone before the profile: alive, their threads had rank
    # 0's 1-sample profile at 17-28 ms where it read 11-22 ms without them (in turns)
    release_kept(kept_keys() - before)
    if 0 < dist.get_rank() < apart:  # loads its core as in training while 0 times
        with fork_rng(device):
            measured_spec(model, samples, loss_fn, num_heads=num_heads, seq_len=seq_len,
                          dtype=dtype, device=device)  # fmt: skip
    return PlanInputs(link, sharing, posting, ratios)


def planning_view(
    model: nn.Module,
    samples: list[tuple[Any, Any]],
    loss_fn: Any,
    inputs: PlanInputs,
    world: int,
    *,
    num_heads: int,
    seq_len: int,
    dtype: str = "fp32",
    device: torch.device | None = None,
    declared: Cluster | None = None,
) -> tuple[ModelSpec, Cluster]:
    """The planner's model and cluster: the blocks profiled here now (`measured_spec`),
    priced with `inputs` on the `world` local workers (or the `declared` cluster's)."""
    device = device or current()
    with fork_rng(device):
        spec = measured_spec(model, samples, loss_fn, num_heads=num_heads, seq_len=seq_len,
                             dtype=dtype, device=device, tp_ratios=inputs.tp_ratios)  # fmt: skip
    cluster = local_cluster(world, inputs.link, dtype, device=device.type,
                            declared=declared, sharing_efficiency=inputs.sharing,
                            message_s=inputs.message_s)  # fmt: skip
    return spec, cluster


def profiled_seconds(spec: ModelSpec, micro_batch_size: int) -> float:
    """Seconds of one forward and backward of every block of `spec` (a `measured_spec`)
    at `micro_batch_size`, on one worker: what the profile read, back from its FLOPs."""
    from plait.sim import SimPlan

    blocks = spec.blocks(micro_batch_size, SimPlan())  # no tp, sp, ep or cp
    return sum(b.forward_flops + b.backward_input_flops + b.backward_weight_flops
               for b in blocks) / _SPEED  # fmt: skip
