"""The one place that reads RANK, WORLD_SIZE and LOCAL_RANK, and joins the process group."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "WorkerEnv", "init_worker", "launched_env", "run_id", "worker_env"]


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of the parallel axes; `build_mesh` lays them out as a DeviceMesh.

    Ranks are laid out (pp, dp, tp) with tp innermost, so that the workers of one
    tensor-parallel group have consecutive ranks, which a launcher places on one node.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check(self, world_size: int, *, local_world_size: int | None = None) -> None:
        """Raise ValueError unless the degrees fit `world_size` workers (and nodes)."""
        if self.world_size != world_size:
            raise ValueError(
                f"dp × tp × pp = {self.dp} × {self.tp} × {self.pp} = {self.world_size} does not "
                f"match the {world_size} workers: choose degrees whose product is {world_size}"
            )
        if local_world_size and local_world_size % self.tp and self.tp > 1:
            raise ValueError(
                f"tp={self.tp} does not divide the {local_world_size} workers of a node: tensor "
                "parallelism must stay inside a node; use a tp that divides it"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        self.check(dist.get_world_size(), local_world_size=_local_world_size())
        return init_device_mesh(
            device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp")
        )


def _local_world_size() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


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
