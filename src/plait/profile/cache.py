"""Profiling a whole model through an on-disk cache of its block measurements (JSON).

A measurement is valid for one model configuration, input shape, dtype, device, thread
count, torch version and machine; the cache key holds all of them, so a change of any one
measures again. Files live in `~/.cache/plait/profile/` (`$XDG_CACHE_HOME/plait/profile`
when set) unless a `cache_dir` is given, one `<sha256 of the key>.json` each.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.blocks import as_blocks
from plait.cluster import Device
from plait.compat import pytree
from plait.cost import BlockCost
from plait.device import device_name
from plait.profile.measure import BlockProfile, LossFn, block_costs, profile_blocks

__all__ = ["ModelProfile", "cache_key", "default_cache_dir", "profile_model"]

_VERSION = 3  # bump when what a measurement means changes


def default_cache_dir() -> Path:
    """Where profiles are cached when no folder is given."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait" / "profile"


@dataclass(frozen=True)
class ModelProfile:
    """The measured blocks of a model, the key they were measured under, and whether they
    came from the cache."""

    blocks: tuple[BlockProfile, ...]
    key: dict[str, Any] = field(compare=False)
    cached: bool = field(default=False, compare=False)

    @property
    def dtype(self) -> str:
        return str(self.key["dtype"])

    def costs(
        self, device: Device, dtype: str | None = None, *, split: bool = False
    ) -> list[BlockCost]:
        """Cost-model blocks, seconds converted at `device`'s rate (the measuring device);
        `split`: backward halves as the split backward costs them (`BlockProfile.to_cost`)."""
        return block_costs(self.blocks, device, dtype or self.dtype, split=split)


def _shapes(value: object) -> list[list[Any]]:
    return [
        [list(t.shape), str(t.dtype)]
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    ]


def cache_key(
    model: nn.Module,
    sample: object,
    *,
    target: object = None,
    loss_fn: LossFn | None = None,
    warmup: int,
    repeats: int,
    device: torch.device | None = None,
    autocast: str = "fp32",
) -> dict[str, Any]:
    """Everything a measurement depends on: model (class and config), input, dtype (of the
    weights, and the training's autocast), device, threads, torch version and machine."""
    first = next(model.parameters(), None)
    where = device if device is not None else (first.device if first is not None else "cpu")
    config = getattr(model, "cfg", None)
    return {
        "version": _VERSION,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": repr(config) if config is not None else repr(model),
        "input": _shapes(sample),
        "target": _shapes(target),
        "loss": getattr(loss_fn, "__qualname__", repr(loss_fn)) if loss_fn else None,
        "dtype": str(first.dtype).removeprefix("torch.") if first is not None else "float32",
        "autocast": autocast,
        "device": str(where),
        "device_name": device_name(torch.device(where)),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}",
        "warmup": warmup,
        "repeats": repeats,
    }


def _path(cache_dir: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir / f"{digest}.json"


def _load(path: Path, key: dict[str, Any]) -> tuple[BlockProfile, ...] | None:
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        return tuple(BlockProfile.from_dict(b) for b in data["blocks"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: measure again


def _store(path: Path, key: dict[str, Any], blocks: Sequence[BlockProfile]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"key": key, "blocks": [b.to_dict() for b in blocks]}, indent=1)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one


def profile_model(
    model: nn.Module,
    sample: object,
    *,
    target: object = None,
    loss_fn: LossFn | None = None,
    names: Sequence[str] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    cache: bool = True,
    cache_dir: Path | str | None = None,
    device: torch.device | None = None,
    dtype: str = "fp32",
) -> ModelProfile:
    """Measure every block of `model` (`plait.blocks.as_blocks`) on one micro-batch
    `sample`, the last with `loss_fn(output, target)`, or read the measurement from the
    cache. `names` defaults to the blocks' class names with their index. `device` and
    `dtype`: measured there, in the training's dtype (`plait.profile.profile_blocks`)."""
    blocks = as_blocks(model)
    key = cache_key(model, sample, target=target, loss_fn=loss_fn, warmup=warmup,
                    repeats=repeats, device=device, autocast=dtype)  # fmt: skip
    path = _path(Path(cache_dir) if cache_dir is not None else default_cache_dir(), key)
    if cache:
        found = _load(path, key)
        if found is not None and len(found) == len(blocks):
            return ModelProfile(found, key, cached=True)
    labels = list(names) if names is not None else _names(blocks)
    measured = profile_blocks(
        blocks,
        sample,
        loss_fn=loss_fn,
        target=target,
        names=labels,
        warmup=warmup,
        repeats=repeats,
        device=device,
        dtype=dtype,
    )
    if cache:
        _store(path, key, measured)
    return ModelProfile(tuple(measured), key)


def _names(blocks: Sequence[nn.Module]) -> list[str]:
    return [f"{i}:{type(b).__name__}" for i, b in enumerate(blocks)]
