"""Starting small gloo worlds for distributed tests: one thread per process, a FileStore,
a 60 s process-group timeout, and every check of a test run inside one world (starting
workers is the expensive part).

Workers start from a fork server that has imported torch and plait once per test process:
a freshly spawned worker spends seconds importing them, a forked one none. Forking from
that server rather than from the test process keeps the workers free of whatever the
test process set up (threads, patched modules); the test process's environment and its
stdout and stderr (which pytest's capture may have redirected) are handed to each worker,
as spawning would."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world", "start_world"]

# imported once by the fork server; a module missing here is imported by each worker
_PRELOAD = ["torch", "torch.distributed", "plait.train", "plait.models", "tests.dist.harness"]
mp.set_forkserver_preload(_PRELOAD)


class _Fd:
    """A file descriptor of the test process that pickles into the same open file in the
    worker (the fork server passes it over its socket)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _Fd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup: Any) -> _Fd:
        return _Fd(dup.detach())


def _entry(
    rank: int,
    world_size: int,
    store_path: str,
    env: dict[str, str],
    outputs: tuple[_Fd, _Fd],
    fn: Callable[..., None],
    args: Any,
) -> None:
    for target, received in zip((1, 2), outputs, strict=True):
        os.dup2(received.fd, target)
        os.close(received.fd)
    os.environ.clear()
    os.environ.update(env)
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
    start_world(tmp_path, world_size, fn, *args, join=True)


def start_world(
    tmp_path: Path, world_size: int, fn: Callable[..., None], *args: Any, join: bool = False
) -> Any:
    """`run_world`, returning at once (join=False) with torch's process context, whose
    `processes` a test that kills some of them waits for one by one."""
    store = tmp_path / f"store-{world_size}-{fn.__name__}"
    return mp.start_processes(
        _entry,
        args=(world_size, str(store), dict(os.environ), (_Fd(1), _Fd(2)), fn, args),
        nprocs=world_size,
        join=join,
        start_method="forkserver",
    )
