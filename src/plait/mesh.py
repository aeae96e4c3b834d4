"""The one place that reads RANK, WORLD_SIZE and LOCAL_RANK, and joins the process group."""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.device import backend_for, worker_device
from plait.layout import check_ep, check_rank_order, expert_replicas, rank_grid

__all__ = [
    "Meshes",
    "ParallelDims",
    "WorkerEnv",
    "cpu_cores_for",
    "init_worker",
    "launched_env",
    "restart_count",
    "run_id",
    "worker_env",
]


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of the parallel axes; `build_mesh` lays them out as DeviceMeshes.

    The world is pp × dp × tp ranks, placed as `rank_order` says (innermost axis first;
    `plait.layout`). The default "tp-dp-pp" keeps a tensor-parallel group on consecutive
    ranks, which a launcher places on one node. `ep` is not a factor of the world: expert
    parallelism borrows data- and tensor-parallel ranks (dp × tp = edp × ep, as
    torchtitan borrows dp_shard × cp × tp with etp=1), so ep must divide dp × tp.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    rank_order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        check_ep(self.ep, self.dp, self.tp)
        check_rank_order(self.rank_order)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the replicas of each expert (dp × tp / ep)."""
        return expert_replicas(self.dp, self.tp, self.ep)

    def check(self, world_size: int, *, local_world_size: int | None = None) -> None:
        """Raise ValueError unless the degrees fit `world_size` workers (and nodes)."""
        if self.world_size != world_size:
            raise ValueError(
                f"dp × tp × pp = {self.dp} × {self.tp} × {self.pp} = {self.world_size} does not "
                f"match the {world_size} workers: choose degrees whose product is {world_size} "
                f"(ep={self.ep} borrows data- and tensor-parallel ranks and adds none)"
            )
        if local_world_size and local_world_size % self.tp and self.tp > 1:
            raise ValueError(
                f"tp={self.tp} does not divide the {local_world_size} workers of a node: tensor "
                "parallelism must stay inside a node; use a tp that divides it"
            )
        across_nodes = local_world_size is not None and local_world_size < world_size
        if self.tp > 1 and across_nodes and self.rank_order.split("-")[0] != "tp":
            raise ValueError(
                f"rank_order={self.rank_order!r} with tp={self.tp} spreads a tensor-parallel "
                "group over non-consecutive ranks, across nodes: use a rank_order starting "
                "with tp (tp-dp-pp or tp-pp-dp)"
            )

    def rank_grid(self) -> list[list[list[int]]]:
        """`grid[pp_index][dp_index][tp_index]`: the global rank at each coordinate."""
        return rank_grid(self.rank_order, pp=self.pp, dp=self.dp, tp=self.tp)

    def expert_grid(self) -> list[list[list[int]]]:
        """`grid[pp_index][edp_index][ep_index]`: the same ranks, dp × tp (tp innermost)
        read as edp × ep with ep innermost (`plait.layout.expert_index`)."""
        flat = [[r for row in plane for r in row] for plane in self.rank_grid()]
        return [[ranks[e * self.ep : (e + 1) * self.ep] for e in range(self.edp)] for ranks in flat]

    def build_mesh(self, device_type: str, *, experts: bool = False) -> Meshes:
        """The main mesh ("pp", "dp", "tp") and, with ep > 1 or a model with `experts`
        under tp > 1, the expert view of the same ranks ("pp", "edp", "ep"). Collective:
        every rank calls it."""
        self.check(dist.get_world_size(), local_world_size=_local_world_size())
        main = DeviceMesh(
            device_type, torch.tensor(self.rank_grid()), mesh_dim_names=("pp", "dp", "tp")
        )
        expert = None
        if self.ep > 1 or (experts and self.tp > 1):
            expert = DeviceMesh(
                device_type, torch.tensor(self.expert_grid()), mesh_dim_names=("pp", "edp", "ep")
            )
        return Meshes(main=main, expert=expert)


@dataclass(frozen=True)
class Meshes:
    """The runtime's meshes: `main` for pipeline, data and tensor parallelism; `expert`, the
    same ranks with dp × tp split into (edp, ep), when experts are spread (ep > 1) or their
    replicas span tensor-parallel ranks (tp > 1), else None."""

    main: DeviceMesh
    expert: DeviceMesh | None = None

    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold different experts and exchange tokens (all-to-all); None
        when ep = 1 (every rank holds every expert: nothing to exchange)."""
        if self.expert is None or self.expert["ep"].size() == 1:
            return None
        return self.expert.get_group("ep")

    def expert_dp_group(self) -> dist.ProcessGroup:
        """The ranks that hold the same experts: expert gradients are averaged over it
        (the whole data-parallel group when there is no expert view)."""
        return self.main.get_group("dp") if self.expert is None else self.expert.get_group("edp")


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


def restart_count() -> int:
    """How many times the launcher has restarted this run's workers (torchrun's elastic
    agent or `plait.train.launch` says so; 0 on the first attempt or without a launcher)."""
    counts = (os.environ.get(k, "0") for k in ("TORCHELASTIC_RESTART_COUNT", "PLAIT_ATTEMPT"))
    return max(int(c) for c in counts)


def run_id() -> str | None:
    """The launch's run id (torchrun's --rdzv-id), shared by every worker of the launch."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def cpu_cores_for(local_rank: int, local_world_size: int, cores: Collection[int]) -> set[int]:
    """The CPU cores a worker is pinned to: an equal contiguous slice of `cores` per local
    worker, or, when workers outnumber cores, core `local_rank mod len(cores)` (so workers
    i and i + cores share one; `plait.cluster.NodeGroup.processors` models that)."""
    if not cores or not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"local rank {local_rank} of {local_world_size} workers on cores {list(cores)}: "
            "the rank must be below the worker count and some core must be allowed"
        )
    ordered = sorted(cores)
    if local_world_size > len(ordered):
        return {ordered[local_rank % len(ordered)]}
    width = len(ordered) // local_world_size
    return set(ordered[local_rank * width : (local_rank + 1) * width])


def _pin_cpu(env: WorkerEnv) -> None:
    """Pin this CPU worker to its cores (`cpu_cores_for`): workers left free migrate
    between cores and run unevenly (steps varied by ±20% here); PLAIT_PIN_CPU=0 disables."""
    local_world = _local_world_size() or env.world_size
    if local_world < 2 or os.environ.get("PLAIT_PIN_CPU", "1") == "0":
        return
    if not hasattr(os, "sched_setaffinity"):  # not on macOS or Windows
        return
    os.sched_setaffinity(0, cpu_cores_for(env.local_rank, local_world, os.sched_getaffinity(0)))


def init_worker(
    *, timeout_s: float = 300.0, device: str = "auto"
) -> tuple[WorkerEnv, torch.device]:
    """Join the default process group on this worker's device (`plait.device`: a GPU of
    its own with NCCL, or the CPU with gloo; `device` is `--device auto|cpu|cuda`). A CPU
    worker is first pinned to its cores (before gloo starts its threads, which inherit the
    pinning)."""
    env = worker_env()
    where = worker_device(device, env.local_rank)
    if where.type == "cpu":
        _pin_cpu(env)
    if not dist.is_initialized():
        # a local `plait.train.launch` meets in a file, not on a TCP port (see there)
        store = os.environ.get("PLAIT_STORE")
        dist.init_process_group(
            backend_for(where),
            init_method=f"file://{store}" if store else None,
            rank=env.rank if store else -1,
            world_size=env.world_size if store else -1,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=where if where.type != "cpu" else None,
        )
        atexit.register(_leave)
    return env, where


def _leave() -> None:
    """At exit, leave the process group `init_worker` joined. A script that ends without
    `destroy_process_group` (as a short one may) otherwise has gloo's threads torn down with
    the interpreter, which can abort the process ("terminate called without an active
    exception") after its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()
