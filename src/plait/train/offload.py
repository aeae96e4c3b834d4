"""Host-memory offload of one stage: saved activations of chosen blocks, and optimizer state.

Activations follow vDNN (Rhu et al., "vDNN: Virtualized Deep Neural Networks for Scalable,
Memory-Efficient Neural Network Design", MICRO 2016): what a block's forward saves for
its backward is copied to host memory as it is saved and copied back when the backward
unpacks it, through torch's saved-tensor hooks, as `torch.autograd.graph.save_on_cpu`
does. Unlike `save_on_cpu`, parameters are not copied (they stay on the device for the
optimizer anyway; copying them would only add transfers) and the bytes moved are
counted. Limits: no prefetch a layer ahead as vDNN schedules it (the copy back happens
when the backward needs the tensor; with pinned memory the copy to the host is
asynchronous); a tensor saved twice is copied twice; with full recomputation only the
block inputs are saved, so there is little left to move. On a CPU device the saved
tensors already live in host memory: nothing is copied, the bytes are still counted.

The optimizer state is swapped, not computed on the host: it lives in host memory between
steps and visits the device for the optimizer step only (step pre/post hooks), so the
device never holds it together with the activations of a step. ZeRO-Offload (Ren et al.
2021) and FSDP2's `CPUOffloadPolicy` instead run the step on the host; the latter also
moves parameters and gradients and, with ZeRO-2/3, would change the sharded gradients
`plait.parallel.sharding` reads from FSDP2's internals. Swapping works the same for
every optimizer plait builds (plain, ZeRO-1's sharded one, FSDP2's DTensor state), keeps
the state dict checkpoints read, and costs two transfers of the state per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from plait.offload import offloaded_blocks

__all__ = [
    "ActivationOffload",
    "OffloadCounter",
    "apply_activation_offload",
    "apply_offload",
    "offload_optimizer_state",
]


@dataclass
class OffloadCounter:
    """Bytes of saved activations handed to host memory since it was made (or reset)."""

    bytes: int = 0
    tensors: int = 0


class ActivationOffload(saved_tensors_hooks):
    """Saved tensors go to host memory while this context is active (parameters stay)."""

    def __init__(self, params: Iterable[torch.Tensor], counter: OffloadCounter) -> None:
        resident = {p.untyped_storage().data_ptr() for p in params}

        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() in resident:
                return t
            counter.bytes += t.numel() * t.element_size()
            counter.tensors += 1
            if t.device.type == "cpu":  # already in host memory
                return t
            # pinned host memory: the copy runs beside the compute, not in its way
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return (t.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)


def apply_activation_offload(
    stage: nn.Module, spec: str, *, num_blocks: int, counter: OffloadCounter | None = None
) -> OffloadCounter:
    """Offload the saved activations of the blocks of `stage` (a StageModule) that `spec`
    (an `offload_activations` value, over a model of `num_blocks` blocks) names. Forward
    hooks open and close the offload context around each chosen block, so parameter
    names (and checkpoints) stay as they were. Returns the counter of bytes moved."""
    counter = counter if counter is not None else OffloadCounter()
    chosen = offloaded_blocks(spec, num_blocks)
    blocks = getattr(stage, "blocks", None)
    if not chosen:
        return counter
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(stage).__name__} has no `.blocks` list: pass a StageModule")
    first = int(getattr(stage, "first_block", 0))
    for i, block in enumerate(blocks):
        if first + i in chosen:
            _hook(block, counter)
    return counter


def apply_offload(
    stages: dict[int, nn.Module],
    optimizers: dict[int, torch.optim.Optimizer],
    *,
    activations: str,
    optimizer: bool,
    num_blocks: int,
) -> OffloadCounter:
    """The plan's offload options on one rank's stages and their optimizers; returns the
    counter of activation bytes moved (all stages together)."""
    counter = OffloadCounter()
    for stage in stages.values():
        apply_activation_offload(stage, activations, num_blocks=num_blocks, counter=counter)
    for opt in optimizers.values() if optimizer else ():
        offload_optimizer_state(opt)
    return counter


def _hook(block: nn.Module, counter: OffloadCounter) -> None:
    open_contexts: list[ActivationOffload] = []

    def enter(module: nn.Module, args: Any) -> None:
        context = ActivationOffload(module.parameters(), counter)
        context.__enter__()
        open_contexts.append(context)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        open_contexts.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, always_call=True)


def offload_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Keep `optimizer`'s state in host memory between steps: moved to its parameter's
    device before each step and back after. Scalar entries (Adam's step counts, which
    torch keeps on the host unless capturable) stay where they are."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one

    def to_device(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        _move_state(opt, None)

    def to_host(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        _move_state(opt, torch.device("cpu"))

    inner.register_step_pre_hook(to_device)
    inner.register_step_post_hook(to_host)


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device | None) -> None:
    """Move every non-scalar state tensor to `device` (None: its parameter's device)."""
    for param, state in optimizer.state.items():
        target = device if device is not None else param.device
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != target:
                state[key] = value.to(target)
