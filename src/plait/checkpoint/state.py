"""An engine's training state under global, layout-free names, for torch.distributed.checkpoint.

A parameter is named as in the whole model (`layers.3.attn.q.weight`), never as in a
pipeline stage (`blocks.0.attn.q.weight`), and tensor- or FSDP-sharded parameters stay
DTensors: DCP writes each rank's shards under those names and, on load, reads into each
rank whatever part of each tensor its own layout holds. So a checkpoint saved under any
(dp, tp, pp, ZeRO, schedule, chunks, partition) loads under any other, at any world size.

torch's `get_model_state_dict` / `get_optimizer_state_dict` (flattened: one key per
parameter and state field, `state.<name>.exp_avg`, `param_groups.<name>.lr`) give each
stage's state with wrapper prefixes (recomputation, FSDP) removed; this module renames
its keys from the stage's to the model's. ZeRO-1's optimizer
(`ZeroRedundancyOptimizer`) is saved through its local optimizer, which holds the state of
this rank's share of the parameters: each rank writes its share, and a new layout reads
its new share. RNG states are saved per rank and restored only on the same world size;
so is gradient compression's state (error-feedback residuals, DGC's momentum, PowerSGD's
factors and step counts), and only under the same compression and buckets too:
otherwise, or when the checkpoint lacks it, it starts afresh (PowerSGD with its plain
all-reduce steps).
An asynchronous stream is drained before a save, so no stashed weight version exists then.
Each pipeline of a heterogeneous plan holds weights of its own (under WSP it trains on
them): pipeline 0's are the model's, pipeline i's are saved beside them under
"pipeline<i>" and loaded by the same layout (another layout loads the model's); under WSP
with the others' updates not yet taken in ("wsp", per rank; `plait.train.wsp`). `steps`,
given to the load, is where WSP's waves resume.

Under expert parallelism each rank of an ep group holds a slice of every expert tensor
(`plait.parallel.experts.shard_experts`: experts [r·E/ep, (r+1)·E/ep) on ep rank r) under
the same name. Those tensors, and their optimizer state, are saved as DTensors sharded on
dim 0 over the ep group, so the checkpoint holds each whole [E, ...] tensor under its
global name and loads under another ep (or none) like any sharded tensor.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from plait.device import rng_state, set_rng_state
from plait.parallel.experts import expert_param_names

if TYPE_CHECKING:
    from plait.mesh import Meshes
    from plait.runtime.sync import GradSync

__all__ = [
    "Engine",
    "drop_unsaved_comm",
    "engine_state",
    "load_engine_state",
    "pipeline_key",
]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STAGE_KEY = re.compile(r"^(state\.|param_groups\.)?blocks\.(\d+)\.(.+)$")


class Engine(Protocol):
    """What a checkpoint reads and writes of a training engine (`plait.train.engine.Engine`
    has it): typed here so that checkpointing does not import the training room above it."""

    @property
    def stages(self) -> Mapping[int, nn.Module]: ...

    @property
    def optimizers(self) -> Mapping[int, torch.optim.Optimizer]: ...

    @property
    def grad_sync(self) -> GradSync | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def block_names(self) -> list[str]: ...

    @property
    def meshes(self) -> Meshes: ...


def _renamer(names: list[str], first_block: int) -> Any:
    def rename(key: str) -> str:
        match = _STAGE_KEY.match(key)
        if match is None:
            raise ValueError(f"stage state key {key!r} is not under blocks.<index>.")
        kind, index, rest = match.groups()
        return f"{kind or ''}{names[first_block + int(index)]}.{rest}"

    return rename


def _inner(optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer(s) whose state this rank holds (ZeRO-1's local one or ones)."""
    parts = getattr(optimizer, "local_optimizers", None)  # ZeRO-1 with experts: ExpertZero
    if parts is not None:
        return parts
    local = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer
    return local if isinstance(local, torch.optim.Optimizer) else optimizer


def engine_state(engine: Engine, *, for_load: bool = False) -> dict[str, Any]:
    """{"model": {global name: tensor}, "optim": {flattened global key: value}, "rng":
    {"rank<r>": this rank's CPU RNG state, "rank<r>.cuda": its GPU's}}: what `dcp.save`
    writes (a collective when stages are FSDP-sharded). `for_load`: the tensors `dcp.load`
    fills, optimizer state included (torch creates a fresh optimizer's state by a step at
    learning rate 0, which it skips while any gradient exists: gradients are cleared
    first, and the data-parallel reducer's buffers are attached again by
    `load_engine_state`)."""
    if for_load:
        for stage in engine.stages.values():
            for p in stage.parameters():
                p.grad = None
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for s, stage in engine.stages.items():
        rename = _renamer(engine.block_names, _first_block(stage))
        whole = _expert_slices(engine, stage)
        for key, tensor in get_model_state_dict(stage).items():
            model[rename(key)] = whole(key, tensor)
        inner = _inner(engine.optimizers[s])
        fresh = not for_load and _never_stepped(inner)
        for key, entry in get_optimizer_state_dict(stage, inner, options=_OPTIONS).items():
            if not (fresh and key.startswith("state.")):  # torch's placeholder state
                optim[rename(key)] = whole(key, entry)
        if fresh:
            _forget_state(inner)
    rank = torch.distributed.get_rank()
    rng = {f"rank{rank}.{k}" if k != "cpu" else f"rank{rank}": v
           for k, v in rng_state(engine.device).items()}  # fmt: skip
    own = pipeline_key(engine)
    state: dict[str, Any] = {"model": model, "optim": optim, "rng": rng}
    if own is not None:  # this pipeline's own weights, not the model's
        state.update({"model": {}, "optim": {}, own: {"model": model, "optim": optim}})
    comm = _comm_state(engine, for_load=for_load)
    if comm:
        state["comm"] = comm
    waves = getattr(engine, "waves", None)
    if waves is not None:
        state["wsp"] = {f"rank{rank}.{k}": v for k, v in waves.state(for_load=for_load).items()}
    return state


def pipeline_key(engine: Any) -> str | None:
    """The pipelines of a heterogeneous plan hold weights of their own: under WSP they
    train on them; synchronous, they differ in the last bits (each clips by a norm summed
    in its own order). Pipeline 0's are saved as the model's (what another layout loads,
    and what an export writes), pipeline i's under "pipeline<i>". None where every rank's
    weights are the model's."""
    groups = getattr(engine, "groups", None)
    return None if groups is None or groups.pipeline == 0 else f"pipeline{groups.pipeline}"


def _comm_state(engine: Engine, *, for_load: bool) -> dict[str, Any]:
    """This rank's gradient compression state (`plait.parallel.compress`): error-feedback
    residuals, one per bucket, under "rank<r>.<bucket>" (DGC adds its momentum and step
    count, "rank<r>.momentum.<bucket>" and "rank<r>.step.<bucket>"), or PowerSGD's state
    as one blob under "rank<r>.powersgd". They are this replica's, so they load only under the same
    world size, compression and buckets (`plait.train.checkpointing.resume`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from plait.parallel.compress import ErrorFeedback, powersgd_state_bytes

    hook_state = getattr(engine.grad_sync, "hook_state", None)
    rank = torch.distributed.get_rank()
    if isinstance(hook_state, PowerSGDState):
        shapes = engine.grad_sync.bucket_shapes()  # type: ignore[union-attr]
        blob = b"" if for_load else powersgd_state_bytes(hook_state, shapes)
        return {f"rank{rank}.powersgd": blob}
    if not isinstance(hook_state, ErrorFeedback):
        return {}
    sizes = engine.grad_sync.bucket_sizes()  # type: ignore[union-attr]
    held = hook_state.saved(sizes, engine.device, for_load=for_load)
    return {f"rank{rank}.{key}": value for key, value in held.items()}


def _optimizers(inner: Any) -> list[torch.optim.Optimizer]:
    return list(inner) if isinstance(inner, list) else [inner]


def _never_stepped(inner: Any) -> bool:
    return not any(o.state for o in _optimizers(inner))


def _forget_state(inner: Any) -> None:
    """Empty the optimizers' state: torch's `get_optimizer_state_dict` creates it in one that
    has not stepped (a step at learning rate 0: Adam's step count 1, moments of zeros),
    which would shift Adam's bias correction for every later step of the run."""
    for o in _optimizers(inner):
        o.state.clear()


def drop_unsaved_comm(state: dict[str, Any], saved_keys: Collection[str]) -> None:
    """Leave out of `state` the compression state a checkpoint lacks (saved before it was
    checkpointed, as PowerSGD's was not at first): that state starts afresh; and the
    random states it lacks; and, for a checkpoint saved before the first update (step 0,
    or steps an fp16 overflow skipped), the optimizer state it has none of."""
    own = next((k for k in state if k.startswith("pipeline")), None)
    if own is not None and any(f"{own}.model.{k}" not in saved_keys for k in state[own]["model"]):
        state.update(state.pop(own))  # saved under another layout: the model's weights
        own = None
    prefix = f"{own}.optim.state." if own is not None else "optim.state."
    if not any(key.startswith(prefix) for key in saved_keys):
        optim = state[own]["optim"] if own is not None else state.get("optim", {})
        for key in [k for k in optim if k.startswith("state.")]:
            del optim[key]
    wsp = state.get("wsp", {})
    if any(f"wsp.{key}" not in saved_keys for key in wsp):
        state.pop("wsp")
    comm = state.get("comm", {})
    if any(f"comm.{key}" not in saved_keys for key in comm):
        state.pop("comm")
    # a GPU's random state is missing from a checkpoint saved on CPU workers: it stays
    rng = state.get("rng", {})
    for key in [k for k in rng if f"rng.{k}" not in saved_keys]:
        del rng[key]


def load_engine_state(
    engine: Engine, state: Mapping[str, Any], *, same_world: bool, steps: int = 0
) -> None:
    """Apply `state` (an `engine_state` that `dcp.load` filled) to the engine's stages and
    optimizers; restore this rank's RNG when the world size is the one saved."""
    own = pipeline_key(engine)
    weights = state[own] if own is not None and own in state else state
    for s, stage in engine.stages.items():
        rename = _renamer(engine.block_names, _first_block(stage))
        ours = {key: rename(key) for key in get_model_state_dict(stage)}
        mine = get_model_state_dict(stage)
        values = {key: _local_slice(weights["model"][ours[key]], mine[key]) for key in ours}
        set_model_state_dict(stage, values)
        inner = _inner(engine.optimizers[s])
        with _implementation_kept(inner), _without_empty_groups(inner):
            keys = get_optimizer_state_dict(stage, inner, options=_OPTIONS)
            if any(rename(k) not in weights["optim"] for k in keys if k.startswith("state.")):
                _forget_state(inner)  # saved before its first update: it starts as it did
                continue
            values = {key: _local_slice(weights["optim"][rename(key)], keys[key]) for key in keys}
            set_optimizer_state_dict(stage, inner, values, options=_OPTIONS)
    rank = f"rank{torch.distributed.get_rank()}"
    saved = state.get("rng", {})
    if same_world and rank in saved:
        kinds = {k.removeprefix(rank).lstrip(".") or "cpu": v for k, v in saved.items()
                 if k == rank or k.startswith(rank + ".")}  # fmt: skip
        set_rng_state(kinds, engine.device)
    _load_comm(engine, state.get("comm", {}), rank)
    waves = getattr(engine, "waves", None)
    if waves is not None:
        saved_waves = {k.partition(".")[2]: v for k, v in state.get("wsp", {}).items()
                       if k.startswith(rank + ".")}  # fmt: skip
        waves.load_state(saved_waves, steps)
    if engine.grad_sync is not None:
        engine.grad_sync.zero_grad()


#: settings of a parameter group that say how torch runs the step, not what it computes
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


@contextmanager
def _implementation_kept(optimizers: Any) -> Iterator[None]:
    """Keep each group's kernel choice (`fused`, `foreach`, ...) across a load: torch's
    `load_state_dict` copies the saved groups' settings over, so a checkpoint saved with
    fused SGD would turn it back on under a layout whose DTensor parameters it cannot run
    on (`plait.train.optim.implementation` chose for this layout)."""
    optims = optimizers if isinstance(optimizers, list) else [optimizers]
    kept = [[{k: g[k] for k in _IMPLEMENTATION if k in g} for g in o.param_groups] for o in optims]
    try:
        yield
    finally:
        for optim, groups in zip(optims, kept, strict=True):
            for group, settings in zip(optim.param_groups, groups, strict=True):
                group.update(settings)


@contextmanager
def _without_empty_groups(optimizers: Any) -> Iterator[None]:
    """Hide the parameter groups without parameters from `optimizers` (one or a list).

    ZeRO-1 gives each rank a share of every group, which may be empty (a rank that got
    only matrices has an empty no-decay group), and torch's flattened optimizer state
    dict names a group's settings by its parameters: an empty group has no entry, and
    `set_optimizer_state_dict` fails on it (IndexError taking its first parameter). Such
    a group has nothing to load, so the load runs without it; afterwards it is put back
    in its place, since ZeroRedundancyOptimizer syncs its own groups with the local
    optimizer's by position. The other groups are the ones `load_state_dict` made."""
    optims = optimizers if isinstance(optimizers, list) else [optimizers]
    every = [optim.param_groups for optim in optims]
    for optim, groups in zip(optims, every, strict=True):
        optim.param_groups = [group for group in groups if group["params"]]
    try:
        yield
    finally:
        for optim, groups in zip(optims, every, strict=True):
            loaded = iter(optim.param_groups)
            optim.param_groups = [next(loaded) if group["params"] else group for group in groups]


def _load_comm(engine: Engine, comm: Mapping[str, Any], rank: str) -> None:
    """Restore this rank's gradient compression state saved by `_comm_state`."""
    from plait.parallel.compress import load_powersgd_state

    hook_state = getattr(engine.grad_sync, "hook_state", None)
    mine = {}
    for key, value in comm.items():
        owner, _, index = key.partition(".")
        if owner != rank:
            continue
        if index == "powersgd":
            shapes = engine.grad_sync.bucket_shapes()  # type: ignore[union-attr]
            if not load_powersgd_state(hook_state, value, shapes, engine.device):
                print(f"plait: {rank}'s PowerSGD state was saved for other parameter shapes; "
                      "it starts afresh", file=sys.stderr, flush=True)  # fmt: skip
        else:
            mine[index] = value
    if mine:
        hook_state.restore(mine)  # type: ignore[union-attr]


def _expert_slices(engine: Engine, stage: nn.Module) -> Any:
    """(stage key, value) -> the value, as a DTensor sharded on dim 0 over the ep group
    when it is an expert tensor's slice (the parameter or its optimizer state)."""
    expert = engine.meshes.expert
    if expert is None:
        return lambda key, value: value
    from torch.distributed.tensor import DTensor, Shard

    names, mesh = set(expert_param_names(stage)), expert["ep"]

    def whole(key: str, value: Any) -> Any:
        name = key.removeprefix("state.").rsplit(".", 1)[0] if key.startswith("state.") else key
        if name in names and isinstance(value, torch.Tensor) and value.dim() > 0:
            if isinstance(value, DTensor):  # ZeRO-2/3 shards it over the expert's replicas
                value = value.full_tensor()
            return DTensor.from_local(value, mesh, [Shard(0)], run_check=False)
        return value

    return whole


def _local_slice(value: Any, like: Any) -> Any:
    """An expert tensor's slice back from the DTensor `_expert_slices` made of it (DCP
    loaded this rank's rows into it), laid out as `like` (the stage's own value: sharded
    again over the expert's replicas under ZeRO-2/3); other values unchanged."""
    names = getattr(getattr(value, "device_mesh", None), "mesh_dim_names", None)
    if names != ("ep",):
        return value
    local = value.to_local()
    if hasattr(like, "device_mesh"):  # every replica holds the whole slice: no transfer
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)
    return local


def _first_block(stage: nn.Module) -> int:
    first = getattr(stage, "first_block", None)
    if not isinstance(first, int):
        raise TypeError(f"{type(stage).__name__} has no `first_block`: pass StageModules")
    return first
