"""Measuring the host time a process takes to issue one block's forward or backward.

The cost model charges `Device.dispatch_s` per block per forward and per backward
(`plait.sim.host`): what Python, torch's dispatcher, autograd's bookkeeping and the kernel
launches cost on the host, apart from the device's own work. It is measured here by
running the model's blocks on a one-token, one-sample input, so the device work is as
small as it gets, and timing on the host clock how long the forward calls and then the
backward call take to return. On a GPU nothing is synchronised inside the timed span:
CUDA kernels launch asynchronously, so what is timed is their issue; on the CPU the tiny
operators run inline, and their few microseconds of arithmetic are counted with the
issue. The figure is the fastest repeat's seconds divided by twice the number of blocks
(each block issues one forward and one backward).

Limits: the embedding and head blocks are averaged with the layers; a full-size
micro-batch may issue more (size-dependent kernel choices) or block on a full launch
queue, which the tiny input does not show.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from plait.cluster import Cluster

__all__ = ["measure_dispatch", "read_dispatch_profile", "with_dispatch"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _issue_s(blocks: Sequence[nn.Module], sample: torch.Tensor, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    value: object = sample
    for block in blocks:
        value = block(value)
    assert isinstance(value, torch.Tensor)
    loss = value.float().sum()
    torch.autograd.backward(loss)
    seconds = time.perf_counter() - start
    _sync(device)  # the device's queue drains outside the timed span
    return seconds


def measure_dispatch(
    blocks: Sequence[nn.Module],
    sample: torch.Tensor,
    *,
    device: torch.device | None = None,
    warmup: int = 3,
    repeats: int = 20,
) -> float:
    """Host seconds to issue one block's forward or backward, from the fastest of
    `repeats` forward-and-backward issues of `blocks` on `sample` (one small input)."""
    if not blocks:
        raise ValueError("measure_dispatch needs at least one block")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    where = device or torch.device("cpu")
    moved = [block.to(where) for block in blocks]
    sample = sample.to(where)
    for _ in range(warmup):
        _issue_s(moved, sample, where)
    best = min(_issue_s(moved, sample, where) for _ in range(repeats))
    for block in moved:
        block.zero_grad(set_to_none=True)
    return best / (2 * len(moved))


def read_dispatch_profile(path: str | Path) -> float | None:
    """`device.dispatch_s` of a profile `plait profile --json` wrote; None for a profile
    without it (analytic, or older)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None  # `read_codec_profile` reads the same file first and names the fault
    device = data.get("device") if isinstance(data, dict) else None
    value = device.get("dispatch_s") if isinstance(device, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"--profile {path}: device.dispatch_s={value!r} must be seconds >= 0")
    return float(value)


def with_dispatch(cluster: Cluster, seconds: float | None) -> Cluster:
    """`cluster` with every device issuing a block action in `seconds` (unchanged for
    None: the cluster's own figures stand)."""
    if seconds is None:
        return cluster
    groups = tuple(replace(g, device=replace(g.device, dispatch_s=seconds)) for g in cluster.groups)
    return replace(cluster, groups=groups)
