"""`--plan auto`: profile the model on the real workers, plan its layout, agree on it.

Rank 0 measures every block on one micro-batch (one thread, like each worker) while the
others wait, then searches the layouts of the local workers with the planner; the plan
is broadcast so every worker builds the same engine. Workers that outnumber the cores
share them, so the local devices are given the speed of a core divided among them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.blocks import as_blocks
from plait.cluster import Link, measured_cluster
from plait.config import ParallelPlan
from plait.plan import SearchSpace, scaled_spec, search
from plait.plan.io import plan_to_dict
from plait.profile import block_costs, measured_device, profile_model

__all__ = ["auto_plan", "core_share", "measure_collectives", "parallel_plan_from"]


def measure_collectives(*, repeats: int = 8) -> Link:
    """The link that reproduces the all-reduce times the workers measure among themselves
    (a collective: call on every worker), as the cost model's ring formula reads it:
    t(bytes) = 2(n-1)·latency + 2(n-1)/n · bytes / bandwidth. Measured while every worker
    takes part, so it includes gloo's and Python's per-call costs and core sharing."""
    import statistics
    import time

    n = dist.get_world_size()
    samples = []
    for size in (256, 64 * 1024, 1024 * 1024):
        t = torch.zeros(size // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        samples.append((float(size), statistics.median(times)))
    (x1, y1), (x2, y2) = samples[0], samples[-1]
    slope = max((y2 - y1) / (x2 - x1), 1e-12)
    steps = 2 * (n - 1)
    latency = max(y1 - slope * x1, 1e-6) / steps
    return Link(latency_s=latency, bandwidth_Bps=steps / n / slope)


def core_share(workers: int) -> float:
    """The share of a core each of `workers` local processes gets."""
    return min(1.0, (os.cpu_count() or 1) / workers)


def parallel_plan_from(data: dict[str, Any]) -> ParallelPlan:
    """The engine's `ParallelPlan` from a plan file's dict (`plait plan --out`)."""
    return ParallelPlan(
        dp=int(data["dp"]), tp=int(data["tp"]), pp=int(data["pp"]),
        schedule=str(data["schedule"]), microbatches=int(data["microbatches"]),
        chunks=int(data.get("chunks", 1)), zero=int(data.get("zero", 0)),
        recompute=str(data.get("recompute", "none")),
        sequence_parallel=bool(data.get("sequence_parallel", False)),
        dtype=str(data.get("dtype", "fp32")),
        partition=tuple(data["partition"]) if data.get("partition") else None,
    )  # fmt: skip


def _measure(
    model: nn.Module, samples: list[tuple[Any, Any]], loss_fn: Any, device: Any, dtype: str
) -> dict[int, list[Any]]:
    """Block costs at each sample's micro-batch size."""
    out = {}
    for x, y in samples:
        profile = profile_model(model, x, target=y, loss_fn=loss_fn, repeats=3)
        out[int(x.shape[0])] = block_costs(profile.blocks, device, dtype, split=True)
    return out


def _search(
    model: nn.Module,
    samples: list[tuple[Any, Any]],
    loss_fn: Any,
    *,
    num_heads: int,
    seq_len: int,
    world: int,
    global_batch: int,
    dtype: str,
    link: Link,
) -> dict[str, Any]:
    speed = 1e9  # any rate: measured seconds become FLOPs at it and back
    share = core_share(world)
    device = measured_device(name="local-cpu", flops=speed, dtype=dtype, memory_bytes=2**34)
    measured = _measure(model, samples, loss_fn, device, dtype)
    sharded = [i for i, b in enumerate(as_blocks(model)) if hasattr(b, "tp_plan")]
    # with no block that shards, tensor parallelism is out: tp must divide 1
    spec = scaled_spec(
        "model", measured, seq_len=seq_len, num_heads=num_heads if sharded else 1, tp_blocks=sharded
    )
    cluster = measured_cluster(
        name="local-workers",
        flops={dtype: speed * share},
        memory_bytes=2**34,
        devices_per_node=world,
        intra_node=link,
    )
    found = search(spec, cluster, global_batch=global_batch, space=SearchSpace(dtype=dtype))
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
) -> dict[str, Any]:
    """The plan every worker trains under (call on every worker; a collective). `samples`
    are micro-batches of one or two sizes, to learn how block costs grow with the size."""
    world = dist.get_world_size()
    link = measure_collectives()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        with torch.random.fork_rng():
            box[0] = _search(
                model,
                samples,
                loss_fn,
                num_heads=num_heads,
                seq_len=seq_len,
                world=world,
                global_batch=global_batch,
                dtype=dtype,
                link=link,
            )
    dist.broadcast_object_list(box, src=0)
    return dict(box[0])
