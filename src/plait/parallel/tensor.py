"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) through DTensor's parallelize_module.

A block declares how it is sharded with a `tp_plan(sequence_parallel: bool)` method
returning a `parallelize_module` plan (GPT's transformer block: q, k, v and the MLP's
first linear column-parallel, the attention output and the MLP's second linear
row-parallel, so each block needs one all-reduce in forward and one in backward per
sub-layer). Blocks that are cheap enough to compute whole on every tensor-parallel rank
say so with `replicated_under_tp = True` (embeddings and the head of the reference GPT).
Any other block with parameters is an error: plait does not guess a plan. A block whose
modules must know the tp degree before they are sharded (Hugging Face GPT-2's attention
splits its fused q|k|v output by a width it stores) also has a `tp_prepare(tp: int)` method,
called just before its plan is applied.

Sequence parallelism (Korthikanti et al. 2022) shards the layer norms' activations along
the sequence inside each block; block boundaries stay whole-sequence, so pipeline stages
exchange the same tensors with or without it.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

__all__ = ["apply_tensor_parallel", "shard_block"]


def apply_tensor_parallel(
    stage: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> None:
    """Shard every block of `stage` (an object with `.blocks`) over `tp_mesh` in place."""
    blocks = getattr(stage, "blocks", None)
    if blocks is None:
        raise TypeError(f"{type(stage).__name__} has no `.blocks`: pass a plait StageModule")
    for block in blocks:
        if getattr(block, "tp_plan", None) is not None:
            shard_block(block, tp_mesh, sequence_parallel=sequence_parallel)
        elif getattr(block, "replicated_under_tp", False) or not any(
            p.requires_grad for p in block.parameters()
        ):
            continue
        else:
            raise ValueError(
                f"block {type(block).__name__} has no tensor-parallel plan: give it a "
                "`tp_plan(sequence_parallel)` method returning a parallelize_module plan, mark "
                "it `replicated_under_tp = True` to compute it whole on every tp rank, or use tp=1"
            )


def shard_block(block: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """Shard one block that has a `tp_plan` over `tp_mesh` in place."""
    prepare = getattr(block, "tp_prepare", None)
    if prepare is not None:
        prepare(tp_mesh.size())
    parallelize_module(block, tp_mesh, cast(Any, block).tp_plan(sequence_parallel))
    _place_keyed_dropout(block, tp_mesh, sequence_parallel)


def _place_keyed_dropout(block: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Tell keyed dropout (plait.keyed) which part of the keyed tensor this rank holds:
    its heads in attention, its sequence shard in a sequence-parallel block's dropouts."""
    rank, size = tp_mesh.get_local_rank(), tp_mesh.size()
    for module in block.modules():
        if hasattr(module, "head_offset") and hasattr(module, "num_heads"):
            heads: int = getattr(module, "num_heads")  # noqa: B009
            setattr(module, "head_offset", rank * (heads // size))  # noqa: B010
        if sequence_parallel and hasattr(module, "split") and hasattr(module, "site"):
            setattr(module, "split", (1, rank, size))  # noqa: B010
