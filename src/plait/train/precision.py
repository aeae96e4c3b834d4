"""Mixed precision: dynamic loss scaling for fp16 autocast (`plait.device.autocast_context`).

fp16 follows Micikevicius et al. 2018: the loss is multiplied by a scale before backward;
gradients are divided by it afterwards; a step whose gradients hold an inf or NaN on any
worker is skipped on every worker and the scale halved; after `growth_interval` clean
steps the scale doubles.

The unscale and the inf check are torch's own kernel,
`torch._amp_foreach_non_finite_check_and_unscale_` (`plait.compat.amp_unscale_`), one
call per (device, dtype) group of local gradients (a DTensor's local shard), then ONE
all-reduce (MAX) of the found-inf flag over all workers; the flag stays a tensor, so
nothing waits for the device here. Why not torch's `GradScaler` or FSDP's
`ShardedGradScaler` (which call the same kernel): both work per optimizer and reduce the
flag per optimizer over one group, whereas a plait rank holds one optimizer per stage
(some wrapped by ZeRO-1) and the check must agree across the pipeline, tensor and
data-parallel ranks at once; and they keep the scale as a device tensor, which the
executor would have to read back to scale each micro-batch's loss. Here the scale is a
host number, changed only at the step's end, when the engine reads the flag together
with the losses (`update`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from plait.compat import amp_unscale_

__all__ = ["LossScaler", "skips_on_device", "step_unless_found"]


class LossScaler:
    """Dynamic loss scale shared by all workers."""

    def __init__(self, *, init_scale: float = 2.0**16, growth_interval: int = 200) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._clean_steps = 0
        self.skipped = 0

    def unscale_(self, params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
        """Divide gradients by the scale; returns a 0-dim float tensor on `device` (the shape
        fused optimizers take), > 0 where some worker (every one calls this) found an inf
        or NaN."""
        found = torch.zeros((), device=device)
        grouped: defaultdict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
        grouped = defaultdict(list)
        for p in params:
            if p.grad is not None:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grouped[(local.device, local.dtype)].append(local)
        with torch.no_grad():
            for (where, _), grads in grouped.items():
                mine = found if where == device else torch.zeros((), device=where)
                inv = torch.full((), 1.0 / self.scale, device=where)
                amp_unscale_(grads, mine, inv)
                if mine is not found:
                    found += mine.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps to resume the scale exactly."""
        return {"scale": self.scale, "clean_steps": self._clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped = int(state.get("skipped", 0))

    def update(self, found_inf: bool) -> None:
        """After a step, once its found-inf flag is read: halve, or count towards doubling."""
        if found_inf:
            self.scale /= 2.0
            self._clean_steps = 0
            self.skipped += 1
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self._clean_steps = 0


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` skips its update itself given a found-inf flag (torch's
    fused Adam, AdamW and SGD: `_step_supports_amp_scaling`; not a wrapper such as
    ZeRO-1's), so that no host read must decide. Not SGD with momentum before its first
    update: torch's fused SGD fills missing momentum buffers with `empty_like` even when
    the update is skipped."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return all(
            g["momentum"] == 0 or optimizer.state.get(p, {}).get("momentum_buffer") is not None
            for g in optimizer.param_groups
            for p in g["params"]
        )
    return True


def step_unless_found(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Step `optimizer` (`skips_on_device`), which leaves its parameters and state as they
    were where `found_inf` > 0: the attribute protocol `torch.amp.GradScaler.step` uses,
    with gradients already unscaled (no `grad_scale`)."""
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
