"""The parallel dimensions on a DeviceMesh: data, tensor and sharded data parallelism."""

from plait.parallel.clip import clip_grad_norm
from plait.parallel.data import GradReducer
from plait.parallel.sharding import FSDPGradSync, apply_fsdp
from plait.parallel.sync import GradSync
from plait.parallel.tensor import apply_tensor_parallel

__all__ = [
    "FSDPGradSync",
    "GradReducer",
    "GradSync",
    "apply_fsdp",
    "apply_tensor_parallel",
    "clip_grad_norm",
]
