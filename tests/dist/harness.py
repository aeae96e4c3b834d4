"""Spawning small gloo worlds for distributed tests: one thread per process, a FileStore,
a 60 s process-group timeout, and every check of a test run inside one spawned world
(spawning is the expensive part)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world"]


def _entry(rank: int, world_size: int, store_path: str, fn: Callable[..., None], args: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_world(tmp_path: Path, world_size: int, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo processes; re-raise failures."""
    store = tmp_path / f"store-{world_size}-{fn.__name__}"
    mp.start_processes(
        _entry,
        args=(world_size, str(store), fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
