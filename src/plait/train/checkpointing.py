"""Saving a training run's checkpoint and resuming from one, on every worker.

What a checkpoint holds besides the engine's tensors (`plait.checkpoint.state`): the step
to resume at (data is a function of the step and the seed), the world size and plan it was
saved under, the config, the fp16 loss scale and the learning-rate schedule's position (its
updates done: the schedule is a closed-form function of it, see `plait.train.optim`, and
the optimizer state holds each group's current learning rate). An asynchronous stream is
saved where it flushes (`flush_every`, a divisor of `checkpoint_every`): the loop has
finished its micro-batches in flight and started a new stream there, whether the run saves
or not, so the checkpoint holds no weight version in flight and a run that resumes from it
starts a new stream at that step, as the run that saved it did. Only the save after the
last step may find a stream in flight (the run ends there): it is drained first.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from plait.checkpoint import Checkpoint, CheckpointStore, engine_state, find, load_engine_state
from plait.checkpoint.safe import SafeLoadPlanner, SafeReader, read_metadata
from plait.checkpoint.state import drop_unsaved_comm
from plait.train.engine import Engine, StepReport

__all__ = ["resume", "save"]


def save(
    engine: Engine, store: CheckpointStore, step: int, info: dict[str, Any]
) -> StepReport | None:
    """Start saving the checkpoint of `step` (the steps done); returns the drain's report
    when an asynchronous stream had to be drained first."""
    drained = engine.drain() if engine.in_flight else None
    extra: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "compress": engine.plan.compress,
        "comm_buckets": _buckets(engine),
    }
    if engine.scaler is not None:
        extra["loss_scale"] = engine.scaler.state_dict()
    waves = getattr(engine, "waves", None)
    if waves is not None:
        extra["wsp"] = _waves(engine, len(waves.pending))
    if engine.schedulers:  # every stage has taken the same updates (a drained stream)
        first = engine.schedulers[min(engine.schedulers)]
        extra["lr_schedule"] = {"last_epoch": first.last_epoch, "step_count": first._step_count}
    store.save(step, engine_state(engine), {**info, **extra})
    if drained is not None:
        engine.restart()
    return drained


def _waves(engine: Any, pending: int) -> dict[str, Any]:
    """What a WSP checkpoint's wave state fits (a `HeteroEngine`'s): the pipelines, D, the
    wave, and the number of waves whose others' updates it holds."""
    layout, waves = engine.groups.layout, engine.waves
    return {"pipelines": [list(r) for r in layout.ranks],
            "sizes": [list(x) for x in layout.sizes],
            "staleness": waves.staleness, "wave": waves.wave, "pending": pending}  # fmt: skip


def _buckets(engine: Engine) -> list[list[int]] | None:
    """The reducer's buckets as [index, entries] (residuals fit only the same ones)."""
    sizes = getattr(engine.grad_sync, "bucket_sizes", None)
    return [[i, n] for i, n in sorted(sizes().items())] if sizes is not None else None


def resume(engine: Engine, store: CheckpointStore, target: str | Checkpoint) -> Checkpoint | None:
    """Load the checkpoint `target` names ("auto": the newest good one in the store's
    folder, None when there is none) into `engine` on every worker; rank 0 chooses and
    tells the others, so all load the same one. A `Checkpoint` (already chosen the same
    way, e.g. to build the engine on its partition) is loaded as it is."""
    if isinstance(target, Checkpoint):
        found: Checkpoint | None = target
    else:
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            box[0] = find(target, store.root)
        dist.broadcast_object_list(box, src=0, group=store.group)
        found = box[0]
    if found is None:
        return None
    same_world = int(found.info.get("world_size", -1)) == dist.get_world_size()
    waves = getattr(engine, "waves", None)
    saved_waves: dict[str, Any] = found.info.get("wsp") or {}
    if waves is not None:  # the same pipelines and waves: their updates in flight too
        alike = same_world and dict(saved_waves, pending=0) == _waves(engine, 0)
        waves.expect(int(saved_waves["pending"]) if alike else 0)
    state = engine_state(engine, for_load=True)
    if not same_world:  # other ranks' RNG streams: nothing of ours to restore
        state.pop("rng")
    if (
        not same_world
        or found.info.get("compress") != engine.plan.compress
        or found.info.get("comm_buckets") != _buckets(engine)
    ):
        state.pop("comm", None)  # another replica's, method's or bucketing's residuals
    metadata = read_metadata(found.path)
    drop_unsaved_comm(state, metadata.state_dict_metadata)
    dcp_load(
        state,
        storage_reader=SafeReader(found.path, metadata),
        planner=SafeLoadPlanner(),
        process_group=store.group,
    )
    load_engine_state(engine, state, same_world=same_world, steps=found.step)
    scale = found.info.get("loss_scale")
    if engine.scaler is not None and scale is not None:
        engine.scaler.load_state_dict(scale)
    _resume_schedule(engine, found.info.get("lr_schedule"))
    if dist.get_rank() == 0 and os.environ.get("PLAIT_ATTEMPT", "0") == "0":
        # after a restart the launcher has already said where the run resumes
        print(f"plait: resuming from step {found.step} ({found.path})", file=sys.stderr, flush=True)
    return found


def _resume_schedule(engine: Engine, saved: dict[str, int] | None) -> None:
    """Put every stage's learning-rate schedule where the saved run's was."""
    if saved is None:
        return
    for s, scheduler in engine.schedulers.items():
        scheduler.last_epoch = saved["last_epoch"]
        scheduler._step_count = saved["step_count"]
        scheduler._last_lr = [g["lr"] for g in engine.optimizers[s].param_groups]
