"""Cutting a global batch: its samples, a rank's rows (and sequence chunks), evaluation's
parts, and moving them to the device."""

from __future__ import annotations

from typing import Any

import torch

from plait.compat import pytree
from plait.parallel.context import zigzag_shard

__all__ = ["batch_size", "eval_parts", "rows", "sequence_shard", "to_device"]


def to_device(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def batch_size(value: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor."""
    leaves = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise ValueError("a batch must hold at least one tensor (its dim 0 counts samples)")
    return int(leaves[0].shape[0])


def eval_parts(size: int, dp: int, index: int, m: int) -> list[tuple[int, int, int, bool]]:
    """(first sample, micro-batches, samples each, counted) of each forward-only program
    that replica `index` of `dp` runs to evaluate `size` samples with `m` micro-batches.
    Every replica runs as many forwards (ZeRO-3 gathers weights in each): replica 0 takes
    the `size % dp` samples left over into its last micro-batch; with fewer samples than
    replicas, each replica computes them all and only replica 0 counts them."""
    share, tail = divmod(size, dp)
    if share == 0:
        return [(0, 1, size, index == 0)] if size else []
    each = -(-share // m)
    count = -(-share // each)
    first = index * share + (tail if index else 0)
    if not tail and share % each == 0:
        return [(first, count, each, True)]
    # two programs on every replica, whatever its own last size: each describes its
    # boundaries anew, and ZeRO-3's probes gather weights there
    last = share - (count - 1) * each + (0 if index else tail)
    full = [(first, count - 1, each, True)] if count > 1 else []
    return [*full, (first + (count - 1) * each, 1, last, True)]


def rows(value: Any, start: int, count: int) -> Any:
    """Samples start..start+count of every tensor of `value` (dim 0)."""
    return pytree.tree_map(
        lambda t: t[start : start + count] if isinstance(t, torch.Tensor) else t, value
    )


def sequence_shard(batch: Any, cp: int, index: int) -> Any:
    """Context-parallel rank `index`'s zigzag chunks of every tensor's sequence (dim 1)."""
    if cp == 1:
        return batch
    return pytree.tree_map_only(torch.Tensor, lambda t: zigzag_shard(t, cp, index, dim=1), batch)
