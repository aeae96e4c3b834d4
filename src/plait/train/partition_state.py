"""The partition a re-partitioned run keeps: saved with its checkpoints and in `plan.json`,
and taken up again by a run that resumes from one of them.

`--repartition auto` moves blocks between pipeline ranks while training
(`plait.train.repartition`). The checkpoint's `plait.json` records the plan the engine ran
when it saved (its `plan.partition` the moved split, its `config` the run's own), the run
folder's `plan.json` is rewritten at each move, and a run that resumes from the checkpoint
with `--repartition auto` and the same layout otherwise builds its engine on the saved
split: a restart does not fall back to the split the run began with. The weights do not
depend on the split (a move computes what the run would have computed without it, and the
clipped norm is summed per block in block order, `plait.parallel.clip`), so a resumed run
goes on bit for bit even where it moves at another step than the run it continues; only
the work per rank is the saved run's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.checkpoint import Checkpoint, find
from plait.config import ParallelPlan, TrainConfig
from plait.config.sections import flat_plan_file, to_file
from plait.train.logs import LOGGER

__all__ = ["current_plan", "find_checkpoint", "resumed_layout", "write_partition"]


def find_checkpoint(target: str | None, root: Path) -> Checkpoint | None:
    """The checkpoint `target` names (`plait.checkpoint.find`), chosen on rank 0 and sent
    to every rank (a collective on the default group), before any engine exists."""
    if target is None:
        return None
    box: list[Any] = [find(target, root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    found: Checkpoint | None = box[0]
    return found


def _apart_from_partition(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if k != "partition"}


def resumed_layout(cfg: TrainConfig, found: Checkpoint | None) -> ParallelPlan:
    """`cfg.parallel`, on the split `found` was saved on when re-partitioning had moved it
    (and the run resumes re-partitioning, on the same layout otherwise)."""
    saved = (found.info.get("plan") if found is not None else None) or {}
    sizes = saved.get("partition")
    ours = cfg.to_dict()["parallel"]
    if (
        cfg.repartition != "auto"
        or sizes is None
        or list(sizes) == list(ours.get("partition") or [])
        or _apart_from_partition(saved) != _apart_from_partition(ours)
    ):
        return cfg.parallel
    if dist.get_rank() == 0:
        logging.getLogger(LOGGER).info(
            "resuming on the re-partitioned split saved at step %s: blocks per stage %s",
            found.step if found is not None else "?", list(sizes),
        )  # fmt: skip
    return dataclasses.replace(cfg.parallel, partition=tuple(sizes))


def current_plan(cfg: TrainConfig, plan: ParallelPlan) -> dict[str, Any]:
    """`cfg`'s layout as a dict (as `config.json` writes it), on `plan`'s partition."""
    out = cfg.to_dict()["parallel"]
    if plan.partition is not None:
        out["partition"] = list(plan.partition)
    return out


def write_partition(run_dir: Path, cfg: TrainConfig, plan: ParallelPlan) -> None:
    """Rewrite the run's `plan.json` on `plan`'s partition (rank 0, after a move): the
    planner's file keeps its other keys and prediction, a layout given by hand is written
    as `plait train` writes it at the end."""
    path = run_dir / "plan.json"
    data = current_plan(cfg, plan)
    if cfg.plan == "auto" and path.is_file():
        data = {**flat_plan_file(json.loads(path.read_text()), str(path)),
                "partition": data["partition"]}  # fmt: skip
    path.write_text(json.dumps(to_file(data), indent=2) + "\n")
