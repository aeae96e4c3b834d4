"""What a tensor-parallel block costs, measured across the workers that would run it.

The planner's measured model (`plait.train.planinputs.measured_spec`) times each block whole
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

The backward is also timed split in its input and weight halves (as zero-bubble
schedules run it), since the halves do not shard alike: the input half holds the
block's all-reduces and most of its DTensor redistributions, the weight half is local
matrix products. On a 2-core host a GPT block of hidden 128 at tp = 2 took 3.6-8.3×
the whole block's input half and 1.5-2.5× its weight half, where its full backward took
3.1-7.4×; one backward ratio for both halves priced the weight half twice over.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.blocks import as_blocks
from plait.device import autocast_context, timer
from plait.profile.measure import _moved, _time_block

__all__ = ["TPRatios", "tp_degrees", "tp_ratios"]

# (tp, sequence parallel) -> micro-batch size -> (forward, backward, backward's input
# half, backward's weight half): seconds of the sharded block over seconds of the whole one
TPRatios = dict[tuple[int, bool], dict[int, tuple[float, float, float, float]]]


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
    cores: int | None = None,
    sharing_efficiency: float = 1.0,
) -> TPRatios:
    """The sharded block's cost over the whole block's (`TPRatios`), measured on this
    rank in a group of each of `degrees` neighbouring workers. Collective: every rank
    calls it with the same arguments (and a model of the same shape); the answer is this
    rank's measurement. Empty when the model has no block with a `tp_plan`.

    Workers outnumbering their `cores` (worker i pinned to core i mod cores) time-share
    them, and the simulator shares a core among the ranks computing on it at
    `sharing_efficiency` (`plait.profile.sharing`), so a block's price must be what it
    costs alone. The whole block is then timed by one worker a core at a time, and the
    sharded one by every worker at once (a group's ranks must run together), which is n
    workers sharing each core: its alone price is that time × efficiency / n. Timing both
    with every worker at once, as before, priced the sharded block's share of what
    time-sharing loses twice, once in the ratio and again in the simulator: the plans of
    tp > 1 were predicted 21% (median) over their steps, the others 8-10% under."""
    from plait.layout import Layout
    from plait.mesh import build_mesh
    from plait.parallel.tensor import shard_block

    blocks = as_blocks(model)
    first = next((i for i, b in enumerate(blocks) if hasattr(b, "tp_plan")), None)
    world = dist.get_world_size()
    bad = [t for t in degrees if t < 2 or world % t]
    if bad:
        raise ValueError(f"tp degrees {bad}: each must be >= 2 and divide the {world} workers")
    if cores is not None and cores < 1:
        raise ValueError(f"cores={cores}: give the host's cores (>= 1)")
    if not 0.0 < sharing_efficiency <= 1.0:
        raise ValueError(f"sharing_efficiency={sharing_efficiency} must be in (0, 1]")
    apart = world if cores is None else min(cores, world)  # workers with a core each
    rank = dist.get_rank()
    sharing = len(range(rank % apart, world, apart))  # workers on this rank's core
    alone = sharing_efficiency / sharing if sharing > 1 else 1.0  # shared seconds -> alone
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
                plain, split = [], []
                # whole and sharded in turns, so that a host slowing down slows both
                for i in range(warmup + repeats):
                    for turn in range(len(range(0, world, apart))):  # one worker a core
                        dist.barrier()
                        if rank // apart == turn:
                            w = _time_block(whole, value, None, warmup=0, repeats=1,
                                            clock=clock, autocast=autocast)  # fmt: skip
                    dist.barrier()  # the group's ranks start each pass together
                    s = _time_block(sharded, value, None, warmup=0, repeats=1, clock=clock,
                                    autocast=autocast)  # fmt: skip
                    if i >= warmup:
                        plain.append(w)
                        split.append(s)
                f, b, bi, bw = (alone * _ratio([t[k] for t in split], [t[k] for t in plain])
                                for k in range(4))  # fmt: skip
                found[size] = (f, b, bi, bw)
    return out


def _ratio(sharded: Sequence[float], whole: Sequence[float]) -> float:
    """Median sharded seconds over median whole seconds (a half the whole block does not
    have prices at 0 whatever its ratio: 1)."""
    w = statistics.median(whole)
    return statistics.median(sharded) / w if w > 0 else 1.0


def _input_of(blocks: Sequence[nn.Module], index: int, x: object) -> object:
    """What block `index` receives in the forward of sample `x`."""
    value = x
    with torch.no_grad():
        for block in blocks[:index]:
            value = block(value)
    return value
