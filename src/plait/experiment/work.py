"""A model's work per block and sample, counted from its code, and its cost on any device.

`count_work` runs each block once on the meta device (no memory, no arithmetic) under
torch's `FlopCounterMode` and a dispatch mode that counts the aten operators and the
elements they touch: FLOPs of forward and backward, the operators a host dispatches (each
one a kernel launch on a GPU), the bytes of the block's output and of everything its
forward writes (what it keeps for backward), the elements the memory-bound operators read
and write, and the FLOPs of 3×3 stride-1 convolutions (which cuDNN may run as Winograd
transforms).

`block_costs` turns that into the cost model's `BlockCost`s for a micro-batch on a device,
as a roofline per operator: the convolutions and matmuls run at the device's achievable
rate, every other operator (batch norm, activations, additions, pooling) at its memory
bandwidth, and a block's time is their sum, expressed as FLOPs at that rate so the
simulator charges it unchanged. A block-level roofline (the larger of all FLOPs and all
traffic) hides the memory-bound operators behind the convolutions they follow, which is
why it predicted ResNet-50 as fast as ResNet-34: its bottlenecks move 4× wider activations
through batch norm. `winograd` divides the 3×3 stride-1 convolutions' arithmetic: Lavin and
Gray (2016) F(2×2, 3×3) needs 2.25× fewer multiplications than direct convolution, and
cuDNN picks it for those layers in fp32 on GPUs without tensor cores.

Limits: each memory-bound operator reads its inputs once and writes its outputs once (cache
reuse and kernel fusion are ignored); the convolutions' own reads and writes are taken as
hidden behind their arithmetic; FLOPs are torch's counts, which charge a grouped
(depthwise) convolution's backward as a dense one: about 10× MobileNetV2's backward
arithmetic, kept because depthwise backward kernels ran no faster than dense ones on the
seeds' GPUs (MobileNetV2 trains about 2× faster than ResNet-50 there, not 14×).
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
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from plait.cluster import Device, dtype_bytes
from plait.compat import pytree
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
    # elements the memory-bound operators (all but convolutions and matmuls) read and write
    forward_memory_elems: float = 0.0
    backward_memory_elems: float = 0.0
    # the part of forward_flops and backward_flops in 3×3 stride-1 convolutions
    forward_winograd_flops: float = 0.0
    backward_winograd_flops: float = 0.0

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


_CONVOLUTIONS = {"convolution", "_convolution", "convolution_backward"}


def _is_winograd(name: str, args: Any) -> bool:
    """A 3×3, stride-1, ungrouped 2-D convolution (forward or backward)."""
    if name not in _CONVOLUTIONS:
        return False
    weight = args[2] if name == "convolution_backward" else args[1]
    stride = args[4] if name == "convolution_backward" else args[3]
    groups = args[9] if name == "convolution_backward" else args[8]
    return (tuple(weight.shape[2:]) == (3, 3) and all(s == 1 for s in stride)
            and groups == 1)  # fmt: skip


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts aten operators, the elements of the tensors they return, the elements the
    memory-bound ones touch and the FLOPs of the Winograd-shaped convolutions."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops, self.elems, self.allocated = 0, 0.0, 0.0
        self.memory, self.winograd = 0.0, 0.0

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
        if func._overloadpacket in flop_registry:
            if _is_winograd(name, args):
                count = flop_registry[func._overloadpacket]
                self.winograd += count(*args, **(kwargs or {}), out_val=out)
        else:
            read = pytree.tree_leaves((args, kwargs or {}))
            self.memory += elems + sum(t.numel() for t in read if isinstance(t, torch.Tensor))
        return out


def count_work(model: nn.Module, sample_shape: Sequence[int]) -> list[BlockWork]:
    """Per-sample work of every block of `model` (which has `blocks()`), fed one input of
    `sample_shape` (without the batch dimension). The model is moved, in place, to the meta
    device; build a full-size model under `with torch.device("meta"):` to skip its weights."""
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
        seed = torch.ones_like(y)  # made outside the counters: the block's backward alone
        with FlopCounterMode(display=False) as b_count, bwd:
            y.backward(seed)
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
                forward_memory_elems=fwd.memory / n,
                backward_memory_elems=bwd.memory / n,
                forward_winograd_flops=fwd.winograd / n,
                backward_winograd_flops=bwd.winograd / n,
            )
        )
        x = y
    return out


def block_costs(
    work: Sequence[BlockWork], device: Device, dtype: str, micro_batch_size: int,
    *, winograd: float = 1.0,
) -> list[BlockCost]:  # fmt: skip
    """The blocks' `BlockCost`s for `micro_batch_size` samples on `device` in `dtype`:
    convolutions and matmuls at the achievable rate (3×3 stride-1 ones with `winograd`
    times less arithmetic), plus the memory-bound operators' traffic at the device's memory
    bandwidth, converted to FLOPs at that rate."""
    if not winograd >= 1.0:
        raise ValueError(f"winograd={winograd} must be >= 1 (1: direct convolution)")
    size = dtype_bytes(dtype)
    rate = device.achievable_flops(dtype)
    per_elem = micro_batch_size * size / device.memory_bandwidth_Bps * rate
    saved = 1.0 - 1.0 / winograd
    costs = []
    for w in work:
        fwd = micro_batch_size * (w.forward_flops - saved * w.forward_winograd_flops)
        fwd += w.forward_memory_elems * per_elem
        bwd = micro_batch_size * (w.backward_flops - saved * w.backward_winograd_flops)
        bwd += w.backward_memory_elems * per_elem
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
