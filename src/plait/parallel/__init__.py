"""The parallel dimensions on a DeviceMesh: data, tensor, sharded data and expert parallelism."""

from plait.parallel.clip import clip_grad_norm
from plait.parallel.data import GradReducer
from plait.parallel.experts import expert_grad_scale, expert_params, shard_experts
from plait.parallel.sharding import FSDPGradSync, apply_fsdp
from plait.parallel.tensor import apply_tensor_parallel
from plait.runtime.sync import GradSync

__all__ = [
    "FSDPGradSync",
    "GradReducer",
    "GradSync",
    "apply_fsdp",
    "apply_tensor_parallel",
    "clip_grad_norm",
    "expert_grad_scale",
    "expert_params",
    "shard_experts",
]
