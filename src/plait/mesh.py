"""The runtime's process groups: the one place that reads RANK, WORLD_SIZE and LOCAL_RANK,
joins the process group, and lays a `plait.layout.Layout` out as DeviceMeshes."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.device import backend_for, worker_device
from plait.layout import AXES, Layout

__all__ = [
    "Meshes",
    "WorkerEnv",
    "agreed_restart_count",
    "build_mesh",
    "check_fits",
    "cpu_cores_for",
    "expert_grid",
    "host_cores",
    "init_worker",
    "kept",
    "kept_keys",
    "launched_env",
    "node_of",
    "pipeline_mesh",
    "rank_grid",
    "release_kept",
    "restart_count",
    "run_id",
    "worker_env",
]


def check_fits(layout: Layout, world_size: int, *, local_world_size: int | None = None) -> None:
    """Raise ValueError unless `layout` fills `world_size` workers and keeps each
    tensor-parallel group inside a node of `local_world_size` workers."""
    if layout.size != world_size:
        named = " × ".join(f"{a}={layout.degree(a)}" for a in AXES if layout.degree(a) > 1)
        raise ValueError(
            f"the layout holds {layout.size} ranks ({named or 'one of each axis'}), not the "
            f"{world_size} workers: choose degrees whose product is {world_size} "
            f"(ep={layout.ep} borrows data- and tensor-parallel ranks and adds none)"
        )
    tp = layout.tp
    if local_world_size and local_world_size % tp and tp > 1:
        raise ValueError(
            f"tp={tp} does not divide the {local_world_size} workers of a node: tensor "
            "parallelism must stay inside a node; use a tp that divides it"
        )
    across_nodes = local_world_size is not None and local_world_size < world_size
    if tp > 1 and across_nodes and layout.rank_order.split("-")[0] != "tp":
        raise ValueError(
            f"rank_order={layout.rank_order!r} with tp={tp} spreads a tensor-parallel "
            "group over non-consecutive ranks, across nodes: use a rank_order starting "
            "with tp (tp-dp-pp or tp-pp-dp)"
        )


def rank_grid(layout: Layout) -> list[Any]:
    """The global rank at every coordinate, nested in `AXES` order (outermost first)."""

    def nest(depth: int, at: dict[str, int]) -> Any:
        if depth == len(AXES):
            return layout.global_rank(at)
        axis = AXES[depth]
        return [nest(depth + 1, {**at, axis: i}) for i in range(layout.degree(axis))]

    return cast(list[Any], nest(0, {}))


def expert_grid(layout: Layout) -> list[list[list[int]]]:
    """`grid[pp_index][edp_index][ep_index]`: the ranks of each pipeline stage read as
    edp × ep (`plait.layout.Layout`'s borrowed view)."""
    firsts = [layout.global_rank({"pp": p}) for p in range(layout.pp)]
    return [[layout.ranks("ep", r) for r in layout.ranks("edp", first)] for first in firsts]


# Communicators made for the current default group, kept by what they connect for another
# engine on the same ranks in this process to reuse (a sweep, a notebook). Each new one
# costs gloo's connection threads until destroyed (`release_kept`): a sweep of 46 plans on
# 4 workers reached 4,400 threads, two thirds of the CPU time in the kernel.
_kept: dict[Hashable, Any] = {}
_WORLD = object()  # the key under which `_kept` remembers which default group it is for
_T = TypeVar("_T")


def kept(key: Hashable, make: Callable[[], _T]) -> _T:
    """`make()`, the first time `key` is asked for under the current default process group
    (a new group after `destroy_process_group` starts afresh); after that the same object.
    Collective where `make` is: every rank asks for the same keys in the same order."""
    world = dist.GroupMember.WORLD
    if _kept.get(_WORLD) is not world:
        _kept.clear()
        _kept[_WORLD] = world
    if key not in _kept:
        _kept[key] = make()
    return cast(_T, _kept[key])


def kept_keys() -> frozenset[Hashable]:
    """The keys `kept` holds now: `release_kept(keys=...)` of those made after it."""
    return frozenset(_kept)


def release_kept(keys: Collection[Hashable] | None = None) -> None:
    """Destroy every communicator `kept` holds (or those under `keys`) and forget them: the
    next engine makes its own. For a process that measures engines of many layouts one
    after another (a sweep): each layout's groups otherwise live on with their gloo threads
    and slow every plan measured after them. Collective: every rank calls it, once no engine
    uses them (an engine dropped but not yet collected holds its groups: collected first)."""
    gc.collect()
    chosen = [v for k, v in _kept.items() if keys is None or (k in keys and k is not _WORLD)]
    groups: dict[str, dist.ProcessGroup] = {}  # by name: a mesh may hand out a new wrapper
    meshes = [m for v in chosen if isinstance(v, Meshes)
              for m in (v.main, v.expert, v.flat_dp, v.flat_dp_cp) if m is not None]  # fmt: skip
    for group in [g for m in meshes for g in m.get_all_groups()] + [
        v for v in chosen if isinstance(v, dist.ProcessGroup)
    ]:
        groups[group.group_name] = group
    # a mesh dimension over every rank is the default group itself, which stays
    groups.pop(dist.GroupMember.WORLD.group_name, None)  # type: ignore[union-attr]
    # a mesh holds its groups (and so gloo's threads) as long as it lives: a mesh and its
    # flattened view refer to each other (freed only when the collector next runs), and
    # DTensor specs cached inside torch keep theirs; emptied, they hold only names
    for mesh in meshes:
        getattr(mesh, "_pg_registry", {}).clear()
    for key in list(_kept) if keys is None else [k for k in keys if k is not _WORLD]:
        _kept.pop(key, None)
    # DTensor's sharding and redistribution caches key on meshes by value: a new mesh of the
    # same ranks would be handed specs naming the destroyed groups
    from torch.distributed.tensor import _redistribute, debug

    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None)):  # fmt: skip
        if clear is not None:  # torch versions differ in which caches they have
            clear()
    dist.barrier()  # no peer is still in a collective on them
    for group in groups.values():
        dist.destroy_process_group(group)


def build_mesh(layout: Layout, device_type: str, *, experts: bool = False) -> Meshes:
    """One DeviceMesh over the layout's axes (`AXES`), with `dp` flattened from
    dp_replicate × dp_shard (torchtitan's way: one mesh, named and flattened sub-meshes),
    and, with ep > 1 or a model with `experts` under tp > 1, the expert view of the same
    ranks ("pp", "edp", "ep"), which borrows across axes and so is a mesh of its own.
    Collective: every rank calls it. The meshes of a layout are made once a process group
    (`kept`)."""
    check_fits(layout, dist.get_world_size(), local_world_size=_local_world_size())
    expert_view = layout.ep > 1 or (experts and layout.tp > 1)
    key = ("mesh", layout, device_type, expert_view)
    return kept(key, lambda: _meshes(layout, device_type, expert_view))


def _meshes(layout: Layout, device_type: str, expert_view: bool) -> Meshes:
    main = DeviceMesh(device_type, torch.tensor(rank_grid(layout)), mesh_dim_names=AXES)
    dp = main[_DP_AXES]._flatten("dp")
    # gradients of replicated weights are reduced over dp and cp as one group
    # (torchtitan's dp_shard_cp): the cp ranks of a replica hold the same weights
    dp_cp = main[(*_DP_AXES, "cp")]._flatten("dp_cp") if layout.cp > 1 else None
    expert = None
    if expert_view:
        grid = torch.tensor(expert_grid(layout))
        expert = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "edp", "ep"))
    return Meshes(main=main, expert=expert, flat_dp=dp, flat_dp_cp=dp_cp)


_DP_AXES = ("dp_replicate", "dp_shard")


def pipeline_mesh(
    layout: Layout, ranks: Sequence[int], pp_group: dist.ProcessGroup, device_type: str
) -> DeviceMesh:
    """The mesh of one pipeline of a heterogeneous plan: `layout` (pp stages, every other
    axis of degree 1) over the pipeline's global `ranks`, on its existing `pp_group`.

    Pipelines of different depths form no regular grid, so there is no world mesh to slice
    or flatten (`DeviceMesh._flatten` is a collective over one); the mesh is assembled from
    process groups instead (`DeviceMesh.from_group`), each size-1 axis on a group of this
    rank alone, and the flattened `dp` view is a size-1 dimension of its own. Collective:
    every rank calls it (the singleton groups are created by all ranks, in order)."""
    if layout.size != layout.pp or len(ranks) != layout.pp:
        raise ValueError(
            f"a pipeline's layout has pp={layout.pp} and no other axis; got {layout} over "
            f"ranks {list(ranks)}"
        )
    singletons = [[r] for r in range(dist.get_world_size())]
    alone, _ = dist.new_subgroups_by_enumeration(singletons)  # type: ignore[no-untyped-call]
    names = (*AXES, "dp")
    grid = torch.tensor(list(ranks)).reshape(layout.pp, *[1] * (len(names) - 1))
    groups = [pp_group if name == "pp" else alone for name in names]
    return DeviceMesh.from_group(groups, device_type, grid, mesh_dim_names=names)


@dataclass(frozen=True)
class Meshes:
    """The runtime's meshes: `main` for pipeline, data and tensor parallelism; `expert`, the
    same ranks with dp × tp split into (edp, ep), when experts are spread (ep > 1) or their
    replicas span tensor-parallel ranks (tp > 1), else None; `flat_dp`, the data-parallel
    mesh `main` flattened (kept here: torch deprecates slicing a flattened dimension from
    the root mesh), None when `main` has a "dp" dimension of its own; `flat_dp_cp`, dp ×
    cp flattened when cp > 1 (the group that reduces gradients then), else None."""

    main: DeviceMesh
    expert: DeviceMesh | None = None
    flat_dp: DeviceMesh | None = None
    flat_dp_cp: DeviceMesh | None = None

    def dp(self) -> DeviceMesh:
        """The data-parallel mesh (1-D)."""
        return self.flat_dp if self.flat_dp is not None else self.main["dp"]

    def grad_dp(self) -> DeviceMesh:
        """The mesh replicated weights' gradients are reduced over: dp × cp flattened
        under context parallelism, else the data-parallel mesh."""
        return self.flat_dp_cp if self.flat_dp_cp is not None else self.dp()

    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel ring, None when cp = 1."""
        names = self.main.mesh_dim_names or ()
        if "cp" not in names or self.main["cp"].size() == 1:
            return None
        return self.main.get_group("cp")

    def fsdp(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: the flattened `dp`, or under HSDP (dp_replicate and
        dp_shard > 1) the 2-D (dp_replicate, dp_shard) mesh, on which FSDP2 shards inside
        a replica group and all-reduces across them; under context parallelism dp × cp
        flattened (torchtitan's dp_shard_cp; HSDP with cp is refused)."""
        names = self.main.mesh_dim_names or ()
        if self.flat_dp_cp is not None:  # cp > 1 (HSDP refused): shard over dp × cp
            return self.flat_dp_cp
        if not set(_DP_AXES) <= set(names) or self.main["dp_replicate"].size() == 1:
            return self.dp()
        return self.main[_DP_AXES]

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


def node_of(rank: int) -> int | None:
    """The node (torchrun's group rank) global rank `rank` runs on, None outside torchrun:
    torchrun numbers ranks node by node, LOCAL_WORLD_SIZE to a node (the same on every
    node, as `check_fits` assumes)."""
    local = _local_world_size()
    return rank // local if local and "GROUP_RANK" in os.environ else None


def restart_count() -> int:
    """How many times the launcher has restarted this run's workers (torchrun's elastic
    agent or `plait.train.launch` says so; 0 on the first attempt or without a launcher)."""
    counts = (os.environ.get(k, "0") for k in ("TORCHELASTIC_RESTART_COUNT", "PLAIT_ATTEMPT"))
    return max(int(c) for c in counts)


def agreed_restart_count(device: torch.device) -> int:
    """`restart_count` as every worker of the launch agrees: the largest over the workers
    (a collective on the default group). torchrun's agents count restarts each for itself:
    the agent whose worker failed counts one, while another agent, whose workers were
    healthy, restarts them for the new rendezvous round without counting
    (pytorch/pytorch#108158), so on its own a worker may not know the run restarted."""
    count = torch.tensor([restart_count()], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


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


# the cores this node's workers were started on, before this one was pinned to its share
_host_cores: int | None = None


def host_cores() -> int:
    """How many cores this node's local workers share: those this process could use before
    `init_worker` pinned it to its own (`cpu_cores_for`), else those it may use now. A
    pinned worker's own affinity is its share, one core of two or four workers on two."""
    if _host_cores is not None:
        return _host_cores
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _pin_cpu(env: WorkerEnv) -> None:
    """Pin this CPU worker to its cores (`cpu_cores_for`): workers left free migrate
    between cores and run unevenly (steps varied by ±20% here); PLAIT_PIN_CPU=0 disables."""
    global _host_cores
    local_world = _local_world_size() or env.world_size
    if local_world < 2 or os.environ.get("PLAIT_PIN_CPU", "1") == "0":
        return
    if not hasattr(os, "sched_setaffinity"):  # not on macOS or Windows
        return
    allowed = os.sched_getaffinity(0)
    if _host_cores is None:  # a second init in this process finds itself pinned already
        _host_cores = len(allowed)
    os.sched_setaffinity(0, cpu_cores_for(env.local_rank, local_world, allowed))


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
