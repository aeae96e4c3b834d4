"""How much of a core's speed CPU workers keep while they time-share it, measured.

When local workers outnumber the host's cores, `plait.mesh.init_worker` pins worker i to
core i mod cores, and the simulator shares each core among the ranks computing on it,
each at `sharing_efficiency / n` of its speed (`plait.schedule.sharing`). What a core
loses to switching between processes and refilling their caches is a property of the
host and the work, not of a plan, so it is measured as the model defines it: the same
forward and backward run by the workers that have a core each, then by every worker at
once, in turns; the efficiency is n × (seconds alone) / (seconds shared).

Fitting it instead to one plan's measured step (a pipeline over all workers) made it
absorb whatever else that plan lost: on a 2-core host with 4 workers the fit gave 0.38-
0.96 over runs of the same code, as the fitted plan's own measurement spread 2× within
a run, while two processes looping one block on one core kept 0.85-0.93 of its speed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["measure_sharing_efficiency"]


def measure_sharing_efficiency(
    model: nn.Module,
    sample: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    cores: int,
    passes: int = 2,
    repeats: int = 5,
) -> float:
    """The share of a core's speed each of the workers pinned to it keeps while all of
    them compute (1.0 when every worker has a core of its own). Collective: every rank
    calls it with a model of the same shape and the same `sample` (inputs, targets);
    every rank returns rank 0's measurement. `passes` forward-and-backward passes make one
    timing; alone and shared take `repeats` turns each, and the medians are compared."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if cores < 1:
        raise ValueError(f"cores={cores}: give the host's cores (>= 1)")
    if world <= cores:
        return 1.0
    sharing = len(range(0, world, cores))  # workers pinned to rank 0's core
    x, y = sample

    def timed() -> float:
        start = perf_counter()
        for _ in range(passes):
            model.zero_grad(set_to_none=True)
            torch.autograd.backward(loss_fn(model(x), y))
        return perf_counter() - start

    timed()  # warm-up: allocations and first-call costs are no one's sharing
    alone, shared = [], []
    for _ in range(repeats):
        dist.barrier()
        if rank < cores:
            alone.append(timed())
        dist.barrier()
        shared.append(timed())
    model.zero_grad(set_to_none=True)
    found = [min(1.0, sharing * statistics.median(alone) / statistics.median(shared))
             if rank == 0 else 0.0]  # fmt: skip
    dist.broadcast_object_list(found, src=0)
    return float(found[0])
