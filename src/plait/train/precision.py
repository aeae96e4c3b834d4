"""Mixed precision: dynamic loss scaling for fp16 autocast (`plait.device.autocast_context`).

fp16 follows Micikevicius et al. 2018: the loss is multiplied by a scale before backward;
gradients are divided by it afterwards; a step whose gradients hold an inf or NaN on any
worker is skipped on every worker and the scale halved; after `growth_interval` clean
steps the scale doubles. torch's GradScaler does this for one optimizer on one process;
here the inf check must agree across all pipeline, tensor and data-parallel ranks, so
plait keeps the few lines it needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scale shared by all workers."""

    def __init__(self, *, init_scale: float = 2.0**16, growth_interval: int = 200) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._clean_steps = 0
        self.skipped = 0

    def unscale_and_check(self, params: list[nn.Parameter]) -> bool:
        """Divide gradients by the scale; True when some worker found an inf or NaN."""
        local_bad = torch.zeros(())
        for p in params:
            if p.grad is None:
                continue
            p.grad.div_(self.scale)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if not torch.isfinite(g).all():
                local_bad.fill_(1.0)
        device = params[0].device if params else torch.device("cpu")
        bad = local_bad.to(device if device.type != "meta" else "cpu")
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps to resume the scale exactly."""
        return {"scale": self.scale, "clean_steps": self._clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped = int(state.get("skipped", 0))

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale /= 2.0
            self._clean_steps = 0
            self.skipped += 1
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self._clean_steps = 0
