"""How much of a core's speed CPU workers keep while they time-share it, measured.

When local workers outnumber the host's cores, `plait.mesh.init_worker` pins worker i to
core i mod cores, and the simulator shares each core among the ranks computing on it,
each at `sharing_efficiency / n` of its speed (`plait.schedule.sharing`). What a core
loses is a property of the host and of how training uses it, not of a plan, so it is
measured on the model as training runs it: the CPU seconds of a forward and backward run
by a worker with a core of its own, against the CPU seconds the same pass costs each
process while every worker runs it at once with its gradients all-reduced among them, as
they are produced (plait's data-parallel reducer, `plait.parallel.data.GradReducer`).
The efficiency is their ratio: the share of a time-shared core's seconds that still
computes. The rest goes to switching between processes, refilling caches and the
communication threads' own copies, which share the core on CPU workers.

Timing only the passes, with no communication, missed most of that loss. On a 2-core
host with 4 workers such a probe kept 0.94-0.999 of the core, while in training the
workers' compute thread took 15-22% more CPU than alone for the same forward and backward
(against 8-12% for the bare passes) and their gloo threads another 10-15%: about a
hundred switches a step per process against a few in the probe. Steps then ran 15-45%
slower than predicted. This probe measures 0.71-0.73 there. Fitting the efficiency to one
plan's measured step instead (a pipeline over all workers) made it absorb whatever else
that plan lost: fits of 0.38-0.96 over runs of the same code.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from time import process_time
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
    repeats: int = 9,
) -> float:
    """The share of a core's speed each of the workers pinned to it keeps while all of
    them train (1.0 when every worker has a core of its own). Collective: every rank
    calls it with a model of the same shape and the same `sample` (inputs, targets);
    every rank returns rank 0's measurement. `passes` forward-and-backward passes make one
    timing; alone and shared take `repeats` turns each, and the medians are compared. The
    passes run on a copy of `model`: its parameters and gradients are left as they were."""
    from plait.parallel.data import GradReducer

    world, rank = dist.get_world_size(), dist.get_rank()
    if cores < 1:
        raise ValueError(f"cores={cores}: give the host's cores (>= 1)")
    if world <= cores:
        return 1.0
    net = copy.deepcopy(model)
    reducer = GradReducer({0: list(net.parameters())}, dist.group.WORLD)  # type: ignore[arg-type]
    x, y = sample

    def timed(shared: bool) -> float:
        start = process_time()  # this process's threads: its gloo threads' copies count
        for _ in range(passes):
            reducer.zero_grad()
            reducer.before_backward(0, last=shared)  # unarmed alone: no reduction
            torch.autograd.backward(loss_fn(net(x), y))
            reducer.after_backward(0, last=shared)
            if shared:
                reducer.finish(0)
        return process_time() - start

    for _ in range(2):  # warm-up: allocations, first calls and gloo's first buffers
        timed(False), timed(True)
    alone, shared = [], []
    for _ in range(repeats):
        dist.barrier()
        if rank < cores:
            alone.append(timed(False))
        dist.barrier()
        shared.append(timed(True))
    found = [min(1.0, statistics.median(alone) / statistics.median(shared))
             if rank == 0 else 0.0]  # fmt: skip
    dist.broadcast_object_list(found, src=0)
    return float(found[0])
