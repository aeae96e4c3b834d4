"""Cutting a model into the stage modules one pipeline rank owns, and its micro-batches."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.blocks import StageModule, as_blocks, equal_split, stage_modules
from plait.compat import pytree
from plait.schedule import Schedule

__all__ = ["local_stages", "split_microbatches"]


def local_stages(
    model: nn.Module,
    schedule: Schedule,
    rank: int,
    *,
    sizes: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> dict[int, StageModule]:
    """The stage modules of `rank` (global stage -> module), moved to `device`.

    `sizes` gives the blocks per model part (a partition; a part per stage unless the
    schedule replicates parts, `Schedule.parts`); by default blocks are split equally.
    Each replica of a part is a copy of its own, starting from the same weights. The other
    ranks' blocks are not kept.
    """
    blocks = as_blocks(model)
    num_parts = schedule.num_parts
    sizes = list(sizes) if sizes is not None else equal_split(len(blocks), num_parts)
    if len(sizes) != num_parts:
        raise ValueError(f"partition has {len(sizes)} stages but the schedule has {num_parts}")
    modules = stage_modules(blocks, sizes)
    mine = schedule.stages_of(rank)
    replicated = num_parts != schedule.num_stages
    return {
        s: (copy.deepcopy(modules[schedule.parts[s]]) if replicated else modules[s]).to(device)
        for s in mine
    }


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of `batch` (a tensor, tuple or dict) along dim 0 into equal parts."""
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on their batch size: {sorted(sizes)}")
    size = sizes.pop()
    if size % num_microbatches:
        raise ValueError(
            f"batch size {size} is not divisible by num_microbatches={num_microbatches}: "
            "use a batch size that is a multiple of the micro-batch count"
        )
    parts = [t.chunk(num_microbatches) if isinstance(t, torch.Tensor) else None for t in leaves]
    return [
        pytree.tree_unflatten(
            [p[i] if p is not None else leaf for p, leaf in zip(parts, leaves, strict=True)], spec
        )
        for i in range(num_microbatches)
    ]
