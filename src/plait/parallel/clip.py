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

Given the model's blocks (`blocks`, plain tensors only), the squared norm is kept per block
in a vector of the model's block count, summed over the pipeline (each block has one
holder, so the sum adds zeros: exact) and then over the blocks in their order. The total is
then the same float whichever rank holds which block: a run that moves blocks between
ranks (`--repartition auto`), or resumes on another split, clips exactly as one that did
not. torch's `get_total_norm` groups by device, not by block, so this one is written here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
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
    blocks: Sequence[tuple[int, Sequence[nn.Parameter]]] | None = None,
    num_blocks: int = 0,
) -> torch.Tensor:
    """Clip the gradients of the whole model to `max_norm`; returns the total norm (a
    0-dim float32 tensor on the gradients' device, the same on every rank of the groups).

    Each pipeline rank holds different parameters, so squared norms are summed over
    `pp_group`. Expert parameters sharded over `ep_group` (`ep_params`, from
    `plait.parallel.experts.expert_params`) differ between its ranks: their squared norms
    are summed over it. Every rank of those groups must call this together.

    `blocks` ((global block index, its parameters) for each block this rank holds, of
    `num_blocks` in the model) makes the norm independent of the split, where every
    gradient is a plain tensor and no experts are sharded (the module docstring).
    """
    sharded = {id(p) for p in ep_params or []} if ep_group is not None else set()
    skip = {id(p) for p in uncounted or []}
    grouped: dict[tuple[bool, Hashable], list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            grouped.setdefault((id(p) in sharded, _kind(p.grad)), []).append(p)
    device = params[0].device if params else torch.device("cpu")
    if blocks is not None and num_blocks > 0 and not sharded and set(grouped) <= {(False, None)}:
        total = _by_block(blocks, num_blocks, skip, device, pp_group)
        for _, members in grouped.items():
            clip_grads_with_norm_(members, max_norm, total)
        return total
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


def _by_block(
    blocks: Sequence[tuple[int, Sequence[nn.Parameter]]],
    num_blocks: int,
    skip: set[int],
    device: torch.device,
    pp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The total norm from each block's squared norm, summed in block order."""
    squares = torch.zeros(num_blocks, device=device, dtype=torch.float32)
    seen: set[int] = set()
    for index, members in blocks:
        grads = []
        for p in members:
            if p.grad is not None and id(p) not in skip and id(p) not in seen:
                seen.add(id(p))
                grads.append(p.grad)
        if grads:
            squares[index] = _square(grads, False)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)  # one holder a block: adds zeros, exact
    return squares.sum().sqrt()
