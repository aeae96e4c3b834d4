"""A model's work per block and sample, counted from its code, and its cost on any device.

`count_work` runs each block once on the meta device (no memory, no arithmetic) under
torch's `FlopCounterMode` and a dispatch mode that counts the aten operators and the
elements they write: FLOPs of forward and backward, the operators a host dispatches (each
one a kernel launch on a GPU), the bytes of the block's output and of everything its
forward writes (what it keeps for backward, and the traffic a memory-bound block pays).
`block_costs` turns that into the cost model's `BlockCost`s for a micro-batch on a device,
as a roofline: a block's time is the larger of its FLOPs at the device's achievable rate
and its memory traffic at the device's memory bandwidth, expressed as FLOPs at that rate
so the simulator charges it unchanged.

Limits: traffic is counted as each operator's output written once and read once (cache
reuse and fused kernels are ignored); batch norm's running statistics and in-place
operators count as writes; FLOPs are torch's counts (convolutions and matmuls only), which
charge a grouped (depthwise) convolution's backward as a dense one: about 10× MobileNetV2's
backward arithmetic, kept because depthwise backward kernels ran no faster than dense ones
on the seeds' GPUs (MobileNetV2 trains about 2× faster than ResNet-50 there, not 14×).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from plait.cluster import Device, dtype_bytes
from plait.cost import BlockCost

__all__ = ["BlockWork", "block_costs", "count_work", "median_abs_error", "relative_error"]


@dataclass(frozen=True)
class BlockWork:
    """One block's work for one sample (FLOPs, elements) and its operator counts."""

    name: str
    forward_flops: float
    backward_flops: float
    forward_ops: int
    backward_ops: int
    output_elems: float  # the tensor handed to the next block
    written_elems: float  # everything the forward writes: its memory traffic
    allocated_elems: float  # what it writes into new memory (what backward may keep)
    num_params: int

    @property
    def ops(self) -> int:
        return self.forward_ops + self.backward_ops


_ALIASES = {
    "detach",
    "alias",
    "t",
    "transpose",
    "permute",
    "expand",
    "squeeze",
    "unsqueeze",
    "reshape",
    "_unsafe_view",
    "as_strided",
    "slice",
    "select",
    "split",
    "chunk",
}


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts aten operators and the elements of the tensors they return."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops, self.elems, self.allocated = 0, 0.0, 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace != "aten" or name in _ALIASES or "view" in name:
            return out  # no kernel: a new header on the same storage
        self.ops += 1
        leaves = out if isinstance(out, tuple | list) else (out,)
        elems = sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))
        self.elems += elems
        if not name.endswith("_"):  # an in-place operator writes into existing memory
            self.allocated += elems
        return out


def count_work(model: nn.Module, sample_shape: Sequence[int]) -> list[BlockWork]:
    """Per-sample work of every block of `model` (which has `blocks()`), fed one input of
    `sample_shape` (without the batch dimension). The model is copied to the meta device."""
    blocks = list(model.to("meta").blocks())  # type: ignore[operator]
    n = 2  # batch norm in training mode refuses one sample of 1×1 features
    x = torch.zeros((n, *sample_shape), device="meta")
    out = []
    for index, block in enumerate(blocks):
        block.train()
        x = x.detach().requires_grad_(index > 0)
        fwd, bwd = _Ops(), _Ops()
        with FlopCounterMode(display=False) as f_count, fwd:
            y = block(x)
        with FlopCounterMode(display=False) as b_count, bwd:
            y.float().sum().backward()
        out.append(
            BlockWork(
                name=f"{type(block).__name__.lstrip('_').lower()}{index}",
                forward_flops=f_count.get_total_flops() / n,
                backward_flops=b_count.get_total_flops() / n,
                forward_ops=fwd.ops,
                backward_ops=bwd.ops,
                output_elems=y.numel() / n,
                written_elems=fwd.elems / n,
                allocated_elems=fwd.allocated / n,
                num_params=sum(p.numel() for p in block.parameters()),
            )
        )
        x = y
    return out


def block_costs(
    work: Sequence[BlockWork], device: Device, dtype: str, micro_batch_size: int
) -> list[BlockCost]:
    """The blocks' `BlockCost`s for `micro_batch_size` samples on `device` in `dtype`:
    the roofline of FLOPs and memory traffic (forward writes its outputs and reads them
    back in backward: about 3 passes over them; backward writes as much again)."""
    size = dtype_bytes(dtype)
    rate = device.achievable_flops(dtype)
    costs = []
    for w in work:
        traffic_s = micro_batch_size * w.written_elems * size / device.memory_bandwidth_Bps
        fwd = max(w.forward_flops * micro_batch_size, traffic_s * rate)
        bwd = max(w.backward_flops * micro_batch_size, 2 * traffic_s * rate)
        costs.append(
            BlockCost(
                name=w.name,
                forward_flops=fwd,
                backward_input_flops=bwd / 2,
                backward_weight_flops=bwd / 2,
                activation_bytes=w.output_elems * micro_batch_size * size,
                saved_bytes=w.allocated_elems * micro_batch_size * size,
                saved_bytes_recompute=w.output_elems * micro_batch_size * size,
                num_params=w.num_params,
                source="counted (plait.experiment.work)",
            )
        )
    return costs


def relative_error(predicted: float | None, published: float | None) -> float | None:
    """|predicted - published| / published, None when either is missing."""
    if predicted is None or published is None or published == 0:
        return None
    return abs(predicted - published) / abs(published)


def median_abs_error(errors: Sequence[float | None]) -> float | None:
    """The median of the errors that exist (None when none do)."""
    present = [e for e in errors if e is not None and math.isfinite(e)]
    return statistics.median(present) if present else None
