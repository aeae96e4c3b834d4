"""Global gradient-norm clipping that is correct across dp, tp, pp and ep.

Built on torch's `get_total_norm` (foreach norms, grouped by device and dtype) and
`clip_grads_with_norm_`, as torchtitan's `clip_grad_norm_` is: the norm stays a tensor
from the first kernel to the last, so no host sync is needed and the caller decides when
to read it. torchtitan assumes one mesh for every DTensor; here gradients come in kinds
that reduce differently, each normed apart with one foreach call:

- plain tensors: whole on this rank, or identical on every dp and tp replica once reduced;
- DTensors, one group per (mesh, placements): their norm is a DTensor whose partial
  placement `full_tensor()` reduces over that mesh (tensor-parallel and FSDP shards);
- expert parameters sharded over the ep group (`ep_params`): their squares add up over it;
- `uncounted` replicas (a part another pipeline rank counts): clipped but left out.

The squared norms then add up over the pipeline with one all-reduce (after one over the
ep group when experts are sharded).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

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
    """Clip the gradients of the whole model to `max_norm`; returns the total norm (a
    0-dim float32 tensor on the gradients' device, the same on every rank of the groups).

    Each pipeline rank holds different parameters, so squared norms are summed over
    `pp_group`. Expert parameters sharded over `ep_group` (`ep_params`, from
    `plait.parallel.experts.expert_params`) differ between its ranks: their squared norms
    are summed over it. Every rank of those groups must call this together.
    """
    sharded = {id(p) for p in ep_params or []} if ep_group is not None else set()
    skip = {id(p) for p in uncounted or []}
    grouped: dict[tuple[bool, Hashable], list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            grouped.setdefault((id(p) in sharded, _kind(p.grad)), []).append(p)
    device = params[0].device if params else torch.device("cpu")
    local = torch.zeros((), device=device, dtype=torch.float32)
    experts = torch.zeros((), device=device, dtype=torch.float32)
    for (expert, kind), members in grouped.items():
        counted = [p.grad for p in members if id(p) not in skip]
        if counted:
            square = _square(counted, kind is not None)
            if expert:
                experts = experts + square
            else:
                local = local + square
    if ep_group is not None and dist.get_world_size(ep_group) > 1:  # on every ep rank alike
        dist.all_reduce(experts, group=ep_group)
    local += experts
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(local, group=pp_group)
    total = local.sqrt()
    for _, members in grouped.items():  # DTensors of one mesh per foreach call
        clip_grads_with_norm_(members, max_norm, total)
    return total


def _kind(grad: torch.Tensor) -> Hashable:
    """How a gradient's norm reduces: None for a plain tensor, else its DTensor layout."""
    if isinstance(grad, DTensor):
        return (grad.device_mesh, grad.placements)
    return None


def _square(grads: list[Any], distributed: bool) -> torch.Tensor:
    """The squared 2-norm of `grads` (all of one kind), whole over their mesh."""
    norm = get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=None)
    if distributed:  # a partial norm: full_tensor reduces it over the DTensors' mesh
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return norm.float() ** 2
