"""Global gradient-norm clipping that is correct across dp, tp and pp."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None,
    ep_group: dist.ProcessGroup | None = None,
    ep_params: list[nn.Parameter] | None = None,
    uncounted: list[nn.Parameter] | None = None,
) -> torch.Tensor:
    """Clip the gradients of the whole model to `max_norm`; returns the total norm.

    Each pipeline rank holds different parameters, so squared norms are summed over the
    pp axis. Within a rank, DTensor gradients (tensor-parallel shards, FSDP shards) give
    their full norm through DTensor's own reductions over tp and dp, and plain gradients
    are identical on every dp and tp replica once reduced, so nothing is counted twice.
    Expert parameters sharded over `ep_group` (`ep_params`, from
    `plait.parallel.experts.expert_params`) differ between its ranks: their squared norms
    are summed over it. `uncounted` parameters are clipped but left out of the norm
    (replicas of a part on another pipeline, whose gradient another rank counts).
    """
    sharded = {id(p) for p in ep_params or []} if ep_group is not None else set()
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    local = torch.zeros((), device=device, dtype=torch.float32)
    experts = torch.zeros((), device=device, dtype=torch.float32)
    skip = {id(p) for p in uncounted or []}
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        norm = torch.linalg.vector_norm(p.grad.float())
        full = getattr(norm, "full_tensor", None)
        square = (full() if full is not None else norm) ** 2
        if id(p) in sharded:
            experts += square
        else:
            local += square
    if ep_group is not None and dist.get_world_size(ep_group) > 1:  # on every ep rank alike
        dist.all_reduce(experts, group=ep_group)
    local += experts
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(local, group=pp_group)
    total = local.sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
