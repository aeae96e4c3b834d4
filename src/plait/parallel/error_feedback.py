"""The error-feedback state of plait's own compression hooks (threshold, top-k, sign and
DGC): each bucket's residual, the group, and the bytes handed to collectives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ErrorFeedback", "finished"]


@dataclass
class ErrorFeedback:
    """State of plait's hooks: the group, the method's parameter, each bucket's residual
    (part of the training state: `state_dict`), and the bytes handed to collectives."""

    process_group: dist.ProcessGroup
    value: float | None
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0

    def accumulate(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The residual of bucket `index` with `grad` added (fp32, whatever the gradient)."""
        residual = self.residuals.get(index)
        if residual is None:
            residual = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
            self.residuals[index] = residual
        return residual.add_(grad.reshape(-1).float())

    def state_dict(self) -> dict[str, Any]:
        return {f"residual.{i}": r for i, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {int(k.split(".", 1)[1]): v.clone() for k, v in state.items()}

    def saved(
        self, sizes: Mapping[int, int], device: torch.device, *, for_load: bool
    ) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of this state, named by bucket (`sizes`: each bucket's
        entries): the residuals (zeros where none yet, or all zeros `for_load`, the
        tensors a load fills in)."""
        out = {}
        for index, n in sizes.items():
            held = self.residuals.get(index)
            if for_load or held is None:
                held = torch.zeros(n, dtype=torch.float32, device=device)
            out[str(index)] = held
        return out

    def restore(self, saved: Mapping[str, torch.Tensor]) -> None:
        """Take back what `saved` gave (as a checkpoint load filled it in)."""
        for key, value in saved.items():
            self.residuals[int(key)] = value.clone()

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same dtype, any length)."""
        group = self.process_group
        world = dist.get_world_size(group)
        size = torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device)
        sizes = [torch.empty_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.numel()] = tensor
        out = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(out, padded, group=group)
        self.bytes_sent += (
            size.numel() * size.element_size() + padded.numel() * padded.element_size()
        )
        return [o[: int(s.item())] for o, s in zip(out, sizes, strict=True)]

    def _gather_same(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape everywhere)."""
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(out, tensor.contiguous(), group=self.process_group)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return out


def finished(bucket: Any, average: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding `average`, copied into the bucket's buffer: what a hook
    returns once its collectives are done."""
    buffer = bucket.buffer()
    buffer.copy_(average.to(buffer.dtype))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
