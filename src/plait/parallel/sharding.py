"""Sharded data parallelism (ZeRO stages 2 and 3, Rajbhandari et al. 2020) via FSDP2.

Each block of a stage is wrapped with `fully_shard` over the dp mesh, then the stage
itself. ZeRO-3 re-shards parameters after every forward (all-gathers them again for the
backward); ZeRO-2 keeps them gathered from forward through backward. Gradients are
reduce-scattered, so each dp rank keeps 1/dp of the gradients and optimizer state.

Pipelines run one backward per micro-batch, so gradient synchronisation is switched off
while micro-batches accumulate and the reduction is triggered by hand after the stage's
last backward, as torch.distributed.pipelining does (FSDP's own end-of-backward callback
never fires for backwards started on stage outputs rather than on a loss). Peers refuse
ZeRO-2/3 with pipelines; here the pipeline executor tells FSDP when a stage is done.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from plait.compat import fsdp_post_backward

__all__ = ["FSDPGradSync", "apply_fsdp"]


def apply_fsdp(
    stage: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    zero: int,
    reduce_dtype: torch.dtype | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> FSDPModule:
    """Shard `stage` (blocks first, then the stage) for ZeRO `zero` (2 or 3) in place;
    `reduce_dtype` (fp16 or bf16 gradient compression) lowers the reduce-scatter's dtype,
    and with it, FSDP2 says, the dtype micro-batch gradients accumulate in.

    Under expert parallelism (`expert_mesh`: the ranks holding the same experts, the
    "edp" dimension of `plait.mesh.Meshes.expert`) each `Experts` module is sharded first,
    over that mesh alone, as torchtitan does: its gradients are reduce-scattered over the
    replicas of its experts, not averaged over data-parallel ranks holding other experts
    (the blocks' own sharding over dp leaves those parameters out), and `FSDPGradSync`
    multiplies them by `expert_scale` (tp/ep: summed over the replicas / dp, as
    `plait.parallel.experts` says). FSDP's own divide factor would do it in the
    reduce-scatter, but gloo lacks the pre-multiplied sum it needs."""
    if zero not in (2, 3):
        raise ValueError(f"zero={zero}: FSDP serves ZeRO stages 2 and 3")
    reshard = zero == 3
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    if expert_mesh is not None:
        from plait.models.moe import Experts

        for module in [m for m in stage.modules() if isinstance(m, Experts)]:
            fully_shard(module, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy)
    for block in getattr(stage, "blocks", []):
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    assert isinstance(stage, FSDPModule)
    return stage


class FSDPGradSync:
    """The executor's `GradSync` for FSDP-sharded stages."""

    def __init__(
        self,
        stages: dict[int, FSDPModule],
        *,
        scaled: dict[int, list[nn.Parameter]] | None = None,
        scale: float = 1.0,
    ) -> None:
        self.stages = stages
        # parameters whose reduced gradients are multiplied by `scale` (expert ones)
        self.scaled, self.scale = scaled or {}, scale

    def before_backward(self, stage: int, *, last: bool) -> None:
        module = self.stages[stage]
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)

    def after_backward(self, stage: int, *, last: bool) -> None:
        if not last:
            return
        module = self.stages[stage]
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        fsdp_post_backward(module)
        if self.scale != 1.0:
            for p in self.scaled.get(stage, []):
                if p.grad is not None:
                    p.grad.mul_(self.scale)

    def reduce(self, stage: int) -> None:
        """The reduce-scatter ran in `after_backward` of the stage's last backward."""

    def zero_grad(self, stage: int | None = None) -> None:
        for s, module in self.stages.items():
            if stage is None or s == stage:
                assert isinstance(module, nn.Module)
                module.zero_grad(set_to_none=True)

    def finish(self, stage: int | None = None) -> None:
        """Reductions finish inside `after_backward`'s final callback."""
