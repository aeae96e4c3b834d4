"""What a tensor-parallel block costs, measured across the workers that would run it.

The planner's measured model (`plait.train.autoplan.measured_spec`) times each block whole
on one worker. Under tensor parallelism the cost model divides a sharded block's work by
tp and adds its activation all-reduces at the measured link, which is what a large layer
on a GPU costs. On small layers (and on CPU workers) a sharded block costs far more: each
DTensor operator adds host time, and the gloo all-reduces are issued and awaited inside
the pass. On a 2-core host, a GPT block of hidden 128 took 6.4 ms whole
(forward and backward, 2 samples) and 31 ms at tp = 2, against the 5.2 ms the division
and the measured all-reduces give. So the block is measured sharded, as Galvatron and
Alpa profile each parallel degree rather than derive it: each group of tp neighbouring
workers shards a copy of the model's first sharded block (`plait.parallel.tensor.shard_block`)
and times its forward and backward beside the whole block, at each sample size, with
and without sequence parallelism. What comes back is the ratio of the two (`TPRatios`),
which `plait.plan.specs.scaled_spec` applies to every sharded block of the model in
place of the division (the blocks a model shards are its repeated layers).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.blocks import as_blocks
from plait.device import autocast_context, timer
from plait.profile.measure import _fresh_input, _leaves, _moved, _run

__all__ = ["TPRatios", "tp_degrees", "tp_ratios"]

# (tp, sequence parallel) -> micro-batch size -> (forward, backward): seconds of the
# sharded block over seconds of the whole one
TPRatios = dict[tuple[int, bool], dict[int, tuple[float, float]]]


def tp_degrees(world: int, num_heads: int) -> list[int]:
    """The tensor-parallel degrees > 1 the planner may choose on `world` local workers:
    those dividing both the workers and the heads."""
    return [t for t in range(2, world + 1) if world % t == 0 and num_heads % t == 0]


def tp_ratios(
    model: nn.Module,
    samples: Sequence[tuple[Any, Any]],
    *,
    degrees: Sequence[int],
    sequence_parallel: Sequence[bool] = (False,),
    dtype: str = "fp32",
    device: torch.device | None = None,
    repeats: int = 7,
    warmup: int = 2,
) -> TPRatios:
    """The sharded block's cost over the whole block's (`TPRatios`), measured on this
    rank in a group of each of `degrees` neighbouring workers. Collective: every rank
    calls it with the same arguments (and a model of the same shape); the answer is this
    rank's measurement. Empty when the model has no block with a `tp_plan`."""
    from plait.layout import Layout
    from plait.mesh import build_mesh
    from plait.parallel.tensor import shard_block

    blocks = as_blocks(model)
    first = next((i for i, b in enumerate(blocks) if hasattr(b, "tp_plan")), None)
    world = dist.get_world_size()
    bad = [t for t in degrees if t < 2 or world % t]
    if bad:
        raise ValueError(f"tp degrees {bad}: each must be >= 2 and divide the {world} workers")
    if first is None or not degrees:
        return {}
    home = next(model.parameters()).device
    device = device or home
    autocast = autocast_context(dtype, device)
    clock = timer(device)
    whole = copy.deepcopy(blocks[first]).to(device)
    # what the block receives in each sample's forward, computed where the model is
    inputs = [(int(x.shape[0]), _moved(_input_of(blocks, first, _moved(x, home)), device))
              for x, _ in samples]  # fmt: skip
    out: TPRatios = {}
    for t in degrees:
        mesh = build_mesh(Layout(dp_replicate=world // t, tp=t), device.type).main["tp"]
        for sp in sequence_parallel:
            sharded = copy.deepcopy(whole)
            shard_block(sharded, mesh, sequence_parallel=sp)
            found = out.setdefault((t, sp), {})
            for size, value in inputs:
                dist.barrier()
                plain = _timed(whole, value, clock, autocast, warmup, repeats)
                dist.barrier()  # the group's ranks start each pass together
                split = _timed(sharded, value, clock, autocast, warmup, repeats)
                found[size] = (split[0] / plain[0], split[1] / plain[1])
    return out


def _input_of(blocks: Sequence[nn.Module], index: int, x: object) -> object:
    """What block `index` receives in the forward of sample `x`."""
    value = x
    with torch.no_grad():
        for block in blocks[:index]:
            value = block(value)
    return value


def _timed(
    block: nn.Module,
    value: object,
    clock: Callable[[], float],
    autocast: Callable[[], Any],
    warmup: int,
    repeats: int,
) -> tuple[float, float]:
    """Median seconds of `block`'s forward and backward of `value`."""
    forward, backward = [], []
    for i in range(warmup + repeats):
        fresh, _ = _fresh_input(value)
        start = clock()
        outs = [t for t in _leaves(_run(block, fresh, None, autocast)) if t.requires_grad]
        middle = clock()
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        end = clock()
        if i >= warmup:
            forward.append(middle - start)
            backward.append(end - middle)
    block.zero_grad(set_to_none=True)
    return statistics.median(forward), statistics.median(backward)
