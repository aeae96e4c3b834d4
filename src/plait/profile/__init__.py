"""Block costs for the cost model: measured on a real device (cached), or derived analytically."""

from plait.profile.analytic import GPTSpec, MoESpec
from plait.profile.cache import ModelProfile, cache_key, default_cache_dir, profile_model
from plait.profile.calibrate import (
    fit_link,
    matmul_flops,
    measured_device,
    message_overheads,
    optimizer_bandwidth,
    pingpong,
    threads,
)
from plait.profile.measure import BlockProfile, block_costs, profile_blocks, torch_dtype_name

__all__ = [
    "BlockProfile",
    "GPTSpec",
    "MoESpec",
    "ModelProfile",
    "block_costs",
    "cache_key",
    "default_cache_dir",
    "fit_link",
    "matmul_flops",
    "measured_device",
    "message_overheads",
    "optimizer_bandwidth",
    "pingpong",
    "profile_blocks",
    "profile_model",
    "threads",
    "torch_dtype_name",
]
