"""Measuring each block of a model on a real device: seconds of forward, full backward and
split backward passes, and the bytes it sends, keeps and holds as parameters.

The backward is timed twice, as the runtime runs it. `backward_s` is one full backward
(`torch.autograd.backward`, gradients accumulated into `.grad`), what 1F1B and GPipe run.
`backward_input_s` and `backward_weight_s` are the two halves zero-bubble schedules run
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), timed with the runtime's own
`plait.runtime.backward` (torch.distributed.pipelining's `stage_backward_input` and
`stage_backward_weight` where that split is exact for the block, else input gradients
first and the full backward after, as the runtime decides); together they may cost more
than one full backward. A block whose input carries no gradient (token ids)
has no input half: its whole backward is the weight half, as in the runtime. Bytes kept
for the backward are the unique storages autograd saves during one forward
(`torch.autograd.graph.saved_tensors_hooks`), parameters excluded; with full
recomputation (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016) a
block keeps only its input. The last block may include the loss, as the last pipeline
stage does. Each time is the median over `repeats` runs after `warmup` runs.

Limits: blocks are timed one at a time, so per-call overheads a fused stage would share
are counted per block, and the split of a stage (which the runtime performs on the whole
stage) is approximated by the sum of its blocks' splits; the input each block sees is
the previous blocks' output on one sample micro-batch; allocator fragmentation is not
measured.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from plait.cluster import Device, normalize_dtype
from plait.compat import pytree
from plait.cost import BlockCost
from plait.device import autocast_context, timer
from plait.runtime.backward import Saved, backward_input, backward_weight, split_is_exact

__all__ = ["BlockProfile", "block_costs", "profile_blocks", "torch_dtype_name"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class BlockProfile:
    """One block measured for one micro-batch: seconds and bytes."""

    name: str
    forward_s: float
    backward_s: float  # one full backward
    backward_input_s: float  # the input half of the split backward
    backward_weight_s: float  # the weight half
    activation_bytes: int  # the output it hands to the next block
    saved_bytes: int  # kept from forward to backward, no recomputation
    input_bytes: int  # kept with full recomputation: its input
    param_bytes: int
    num_params: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> BlockProfile:
        return BlockProfile(**data)

    def to_cost(self, device: Device, dtype: str, *, split: bool = False) -> BlockCost:
        """The cost-model record: seconds become FLOPs at `device`'s rate in `dtype`.

        With `split` the backward halves are the split's measured ones (for schedules that
        run BI and BW); without, they add up to the full backward, in the split's ratio.
        """
        bi, bw = self.backward_input_s, self.backward_weight_s
        if not split:
            share = bi / (bi + bw) if bi + bw > 0 else 0.0
            bi, bw = self.backward_s * share, self.backward_s * (1.0 - share)
        return BlockCost.from_seconds(
            self.name,
            forward_s=self.forward_s,
            backward_input_s=bi,
            backward_weight_s=bw,
            device=device,
            dtype=dtype,
            activation_bytes=self.activation_bytes,
            saved_bytes=self.saved_bytes,
            saved_bytes_recompute=min(self.input_bytes, self.saved_bytes),
            num_params=self.num_params,
        )


def block_costs(
    profiles: Sequence[BlockProfile], device: Device, dtype: str, *, split: bool = False
) -> list[BlockCost]:
    """`BlockProfile.to_cost` of every block."""
    return [p.to_cost(device, dtype, split=split) for p in profiles]


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The canonical plait dtype name (`fp32`, `bf16`, ...) of a torch dtype."""
    return normalize_dtype(str(dtype).removeprefix("torch."))


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views share theirs)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of `tensors` as sent over a stage boundary (contiguous copies)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _leaves(value: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _fresh_input(value: object) -> tuple[object, list[torch.Tensor]]:
    """`value` with its floating tensors detached as new leaves requiring grad, as the
    runtime hands a stage its received input; returns (value, those leaves)."""
    leaves, spec = pytree.tree_flatten(value)
    out, grads = [], []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().requires_grad_(True)
            grads.append(t)
        out.append(t)
    return pytree.tree_unflatten(out, spec), grads


def _run(
    block: nn.Module,
    x: object,
    loss: Callable[[object], torch.Tensor] | None,
    autocast: Callable[[], AbstractContextManager[Any]],
) -> object:
    with autocast():  # the forward as training runs it; the backward outside, as there
        out = block(x)
        return loss(out) if loss is not None else out


def _saved_bytes(
    block: nn.Module,
    x: object,
    loss: Callable[[object], torch.Tensor] | None,
    autocast: Callable[[], AbstractContextManager[Any]],
) -> tuple[int, object]:
    """Bytes autograd saves in one forward (parameters excluded), and the output."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value, _ = _fresh_input(x)
        out = _run(block, value, loss, autocast)
    return _storage_bytes(saved), out


def _pass(
    block: nn.Module,
    x: object,
    loss: Callable[[object], torch.Tensor] | None,
    clock: Callable[[], float],
    autocast: Callable[[], AbstractContextManager[Any]],
) -> tuple[float, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One timed forward: seconds, the new input leaves, the outputs needing a gradient,
    and gradients for them."""
    value, inputs = _fresh_input(x)
    start = clock()
    outs = [t for t in _leaves(_run(block, value, loss, autocast)) if t.requires_grad]
    seconds = clock() - start
    return seconds, inputs, outs, [torch.ones_like(t) for t in outs]


def _time_block(
    block: nn.Module,
    x: object,
    loss: Callable[[object], torch.Tensor] | None,
    *,
    warmup: int,
    repeats: int,
    clock: Callable[[], float],
    autocast: Callable[[], AbstractContextManager[Any]],
) -> tuple[float, float, float, float]:
    """Median seconds of forward, full backward, and the split's input and weight halves."""
    samples: list[tuple[float, float, float, float]] = []
    exact: bool | None = None
    for i in range(warmup + repeats):
        forward, inputs, outs, grads = _pass(block, x, loss, clock, autocast)
        start = clock()
        if outs:
            torch.autograd.backward(outs, grads)
        full = clock() - start
        _, inputs, outs, grads = _pass(block, x, loss, clock, autocast)
        # torch's split detaches the outputs in place, which a view refuses (a sequence-
        # parallel block's output is one); a stage's outputs in the runtime are not views
        outs = [t.clone() if t._is_view() else t for t in outs]
        saved = Saved(inputs=inputs, outputs=outs)
        if exact is None:  # the block's structure decides, as the runtime decides per stage
            exact = split_is_exact(saved, block)
        start = clock()
        backward_input(saved, grads, block, exact=exact)
        middle = clock()
        if not any(t.requires_grad for t in inputs):  # no input half: its call only returned
            middle = start
        backward_weight(saved, block)  # no input gradient: the full backward, as in the runtime
        halves = (middle - start, clock() - middle)
        if i >= warmup:
            samples.append((forward, full, *halves))
    block.zero_grad(set_to_none=True)
    f, b, bi, bw = (statistics.median(column) for column in zip(*samples, strict=True))
    return f, b, bi, bw


def _moved(value: object, device: torch.device | None) -> Any:
    if device is None:
        return value
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _check(
    blocks: Sequence[nn.Module], names: Sequence[str] | None, warmup: int, repeats: int
) -> None:
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup={warmup} must be >= 0 and repeats={repeats} >= 1")
    if not blocks:
        raise ValueError("no blocks to profile: give at least one module")
    if names is not None and len(names) != len(blocks):
        raise ValueError(f"{len(names)} names for {len(blocks)} blocks: give one name each")


def profile_blocks(
    blocks: Sequence[nn.Module],
    sample: object,
    *,
    loss_fn: LossFn | None = None,
    target: object = None,
    names: Sequence[str] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device: torch.device | None = None,
    dtype: str = "fp32",
) -> list[BlockProfile]:
    """Measure `blocks` in order on one micro-batch `sample`; the last block includes
    `loss_fn(output, target)` when given.

    Each block sees the previous block's output. With `device`, each block is measured on
    it as a copy (one block there at a time; the blocks given stay where they are) and the
    sample and target are moved there; without, on the blocks' own device. `dtype` is the
    training's: the forward runs under its autocast (`plait.device.autocast_context`), with
    the weights as they are, as training runs it. Parameters are left without gradients.
    """
    _check(blocks, names, warmup, repeats)
    first = next((p for b in blocks for p in b.parameters()), None)
    where = device or (first.device if first is not None else torch.device("cpu"))
    clock, autocast = timer(where), autocast_context(dtype, where)
    out: list[BlockProfile] = []
    x, target = (_moved(v, device) for v in (sample, target))
    for index, given in enumerate(blocks):
        block = copy.deepcopy(given).to(device) if device is not None else given
        last = index == len(blocks) - 1
        loss = (lambda y: loss_fn(y, target)) if last and loss_fn is not None else None
        saved, y = _saved_bytes(block, x, loss, autocast)
        f, b, bi, bw = _time_block(block, x, loss, warmup=warmup, repeats=repeats, clock=clock,
                                   autocast=autocast)  # fmt: skip
        params = list(block.parameters())
        out.append(
            BlockProfile(
                name=names[index] if names is not None else f"block{index}",
                forward_s=f,
                backward_s=b,
                backward_input_s=bi,
                backward_weight_s=bw,
                activation_bytes=_tensor_bytes(_leaves(y)),
                saved_bytes=saved,
                input_bytes=_tensor_bytes(_leaves(x)),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                num_params=sum(p.numel() for p in params),
            )
        )
        with torch.no_grad():
            x = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    return out
