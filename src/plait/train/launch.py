"""Starting N local workers through torch's elastic launcher (torchrun's machinery)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "launch"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], *args: Any) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import record

    # `record` writes the worker's traceback where the launcher reports it
    return record(fn)(*args)


def launch(fn: Callable[..., Any], nproc: int, *args: Any, threads: int = 1) -> dict[int, Any]:
    """Run `fn(*args)` on `nproc` local worker processes; returns {rank: return value}.

    Each worker finds RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT in its environment
    (read them with `plait.mesh.worker_env`). A worker that fails makes the launch raise
    with that worker's error. `fn` must be importable (defined at module level).
    """
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"nproc={nproc}: launch at least 1 worker")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"is_host": True},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(),
    )
    return dict(elastic_launch(config, _worker)(fn, *args))
