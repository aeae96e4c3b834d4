"""ZeRO-1 for a model with experts spread by expert parallelism: two partitioned optimizers.

torch's `ZeroRedundancyOptimizer` (ZeRO stage 1, Rajbhandari et al. 2020) partitions the
parameters it is given over one process group: each rank updates its share and broadcasts
it over that group. Under expert parallelism the ranks of the data-parallel group hold
different experts, so the experts must be partitioned and broadcast over the ranks that
hold the same ones (the expert-data-parallel group, `plait.mesh.Meshes.expert_dp_group`),
the other parameters over the data-parallel group, as DeepSpeed-MoE does with its
separate expert parameter groups. `ExpertZero` steps one `ZeroRedundancyOptimizer` for
each and looks like one optimizer to the engine and its learning-rate schedule (it shares
their parameter-group dictionaries). Checkpoints save the state each rank holds, through
`local_optimizers` (`plait.checkpoint.state`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["ExpertZero", "partitioned"]


def partitioned(
    optimizer: torch.optim.Optimizer, group: dist.ProcessGroup
) -> torch.optim.Optimizer:
    """`optimizer` (built over its parameters by a factory) as a ZeroRedundancyOptimizer
    over `group`, keeping its class, settings and parameter groups."""
    # `defaults` may hold entries the constructor does not take (AdamW's
    # decoupled_weight_decay): pass on only the constructor's own arguments
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    # keep the factory's parameter groups (weight-decay exclusions) and their settings
    groups = [
        {k: v for k, v in g.items() if k == "params" or v != optimizer.defaults.get(k)}
        for g in optimizer.param_groups
    ]
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), process_group=group, **settings
    )


class ExpertZero(torch.optim.Optimizer):
    """Steps `parts` (the non-expert and the expert optimizers) as one. `param_groups` are
    the parts' own dictionaries, so that a schedule's learning rate reaches them."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        groups = [g for part in parts for g in part.param_groups]
        super().__init__(groups, dict(parts[0].defaults))

    @property
    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers holding this rank's state (each part's local one)."""
        return [getattr(p, "optim", p) for p in self.parts]

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("ExpertZero.step takes no closure")
        for part in self.parts:
            part.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "ExpertZero keeps its state in its parts: save `local_optimizers` (as "
            "plait.checkpoint does through torch.distributed.checkpoint)"
        )
