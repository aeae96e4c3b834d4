"""The one place that reads RANK, WORLD_SIZE and LOCAL_RANK, and joins the process group."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["WorkerEnv", "init_worker", "launched_env", "run_id", "worker_env"]


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int


def worker_env() -> WorkerEnv:
    """This worker's place, from the variables torchrun (or plait's launcher) sets."""
    try:
        return WorkerEnv(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )
    except KeyError as err:
        raise RuntimeError(
            f"{err.args[0]} is not set: start workers with `plait train --nproc N` or torchrun"
        ) from None


def launched_env() -> WorkerEnv | None:
    """This process's place when a launcher (torchrun) started it, else None."""
    return worker_env() if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def run_id() -> str | None:
    """The launch's run id (torchrun's --rdzv-id), shared by every worker of the launch."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def init_worker(*, timeout_s: float = 300.0) -> tuple[WorkerEnv, torch.device]:
    """Join the default process group (NCCL on GPUs, gloo on CPU) and pick the device."""
    env = worker_env()
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return env, device
