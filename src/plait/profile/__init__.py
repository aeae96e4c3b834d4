"""Block costs for the cost model: measured on a real device (cached), or derived analytically.

The measuring modules need torch; the analytic specs do not, and `plait plan` and `plait
simulate` read only those, so the measuring names are imported on first use (PEP 562):
importing torch cost a planner run seconds of its time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plait.profile.analytic import GPTSpec, MoESpec

if TYPE_CHECKING:
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
    from plait.profile.measure import (
        BlockProfile,
        block_costs,
        profile_blocks,
        torch_dtype_name,
    )

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

_MODULES = {
    "cache": ("ModelProfile", "cache_key", "default_cache_dir", "profile_model"),
    "calibrate": ("fit_link", "matmul_flops", "measured_device", "message_overheads",
                  "optimizer_bandwidth", "pingpong", "threads"),
    "measure": ("BlockProfile", "block_costs", "profile_blocks", "torch_dtype_name"),
}  # fmt: skip
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"plait.profile.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
