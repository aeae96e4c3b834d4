"""A chosen plan as plain JSON, read back by `plait train --plan` and `plait simulate --plan`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from plait.config import ParallelPlan
from plait.config.sections import flat_plan_file, to_file
from plait.plan.search import RankedPlan
from plait.sim import SimPlan

__all__ = [
    "LAYOUT_KEYS",
    "PLAN_KEYS",
    "TRAIN_BATCH_KEYS",
    "check_trainable",
    "parallel_plan_of",
    "plan_from_dict",
    "plan_to_dict",
    "read_plan",
    "write_plan",
]

# A plan file holds one `ParallelPlan` (the plan type training, the planner and the
# simulator share) under its own field names, the batch, and what was predicted for it.
LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(ParallelPlan))
# plan-file keys that are no `ParallelPlan` field: the batch, which `plait train` sets
TRAIN_BATCH_KEYS = ("micro_batch_size", "global_batch")
PLAN_KEYS = LAYOUT_KEYS + TRAIN_BATCH_KEYS
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelPlan)}

_KINDS: dict[str, type] = {"micro_batch_size": int, "global_batch": int, "model": dict}
_KIND_NAMES = {int: "an integer", dict: "an object"}


def plan_to_dict(
    ranked: RankedPlan, *, model: dict[str, Any] | None = None, cluster: str | None = None
) -> dict[str, Any]:
    """The plan (layout and batch) and what the simulator predicts for it."""
    p = ranked.plan
    # a heterogeneous plan's pipelines are the planner's `HeteroPlan`'s (below)
    values = p.to_dict()
    out: dict[str, Any] = {key: values[key] for key in LAYOUT_KEYS if key in values}
    out.pop("pipelines", None)
    # pipelines of different depths: the top-level cut is the first pipeline's, as pp is
    out["partition"] = list(p.partition if p.pipelines and p.partition else ranked.sizes)
    out["micro_batch_size"] = p.micro_batch_size
    out["global_batch"] = p.global_batch_size
    out["predicted"] = {
        "step_time_s": ranked.step_time_s, "tokens_per_s": ranked.tokens_per_s,
        "mfu": ranked.mfu, "bubble_fraction": ranked.bubble_fraction,
        "comm_share": ranked.comm_share, "peak_memory_bytes": list(ranked.peak_memory_bytes),
        "headroom_bytes": ranked.headroom_bytes,
    }  # fmt: skip
    if ranked.loader_step_s > 0:  # the input pipeline was modelled
        out["predicted"]["loader_step_s"] = ranked.loader_step_s
        out["predicted"]["simulated_step_s"] = ranked.simulated_step_s
    if ranked.hetero is not None:
        out["pipelines"] = [
            {"devices": list(r.devices), "partition": list(r.sizes),
             "microbatches": r.num_microbatches}
            for r in ranked.hetero.replicas
        ]  # fmt: skip
    if model is not None:
        out["model"] = model
    if cluster is not None:
        out["cluster"] = cluster
    return out


def _layout_values(data: dict[str, Any], *, complete: bool = True) -> dict[str, Any]:
    """Every layout field a plan file's dict gives, and training's default for the rest:
    a hand-written file reads the same to the simulator and to training. `complete`:
    the keys no plan is without must be there."""
    missing = [k for k in ("dp", "tp", "pp", "schedule", "microbatches") if k not in data]
    if missing and complete:
        raise ValueError(f"plan file lacks keys {missing}; write plans with `plait plan --out`")
    for key, kind in _KINDS.items():  # int() would read "2" and 2.7 as counts
        value = data.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(f"{key}={value!r} must be {_KIND_NAMES[kind]}")
    values = {k: data[k] for k in LAYOUT_KEYS if data.get(k) is not None}
    return {**_DEFAULTS, **values}


def plan_from_dict(data: dict[str, Any]) -> SimPlan:
    """The `SimPlan` a plan file describes: its layout, the batch and the model's
    sequence length."""
    return SimPlan(
        **_layout_values(data),
        micro_batch_size=data.get("micro_batch_size", 1),
        seq_len=data.get("model", {}).get("seq_len", 1),
    )


def check_trainable(data: dict[str, Any]) -> None:
    """Raise ValueError for what a plan file may say that training cannot apply yet.
    (Heterogeneous `pipelines` train: `plait.train.hetero`.)"""
    pipelines = data.get("pipelines")
    if pipelines is not None and not isinstance(pipelines, list):
        raise ValueError(f"pipelines={pipelines!r} must be a list of per-pipeline objects")


def parallel_plan_of(data: dict[str, Any]) -> ParallelPlan:
    """The training layout a plan file's dict describes: every `ParallelPlan` field is a
    plan-file key of the same name. Refuses what training cannot apply (`check_trainable`)."""
    check_trainable(data)
    values = _layout_values(data, complete=False)
    first = (data.get("pipelines") or [None])[0]
    if isinstance(first, dict) and isinstance(first.get("microbatches"), int):
        # each pipeline runs its own count; the top-level one (the planner's equal split)
        # becomes the first pipeline's, by which the logs count rank 0's micro-batches
        values["microbatches"] = first["microbatches"]
    return ParallelPlan(**values)


def write_plan(path: str | Path, data: dict[str, Any]) -> None:
    """`data` (a plan's keys, flat) as a plan file: the plan's fields in their sections
    (`plait.config.sections`), the batch, the prediction and the model beside them."""
    Path(path).write_text(json.dumps(to_file(data), indent=2) + "\n")


def read_plan(path: str | Path) -> dict[str, Any]:
    if Path(path).is_dir():
        raise ValueError(f"plan file {path} is a folder: give the file `plait plan --out` wrote")
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(
            f"plan file {path} does not exist: write one with `plait plan --out`"
        ) from None
    except json.JSONDecodeError as err:
        raise ValueError(f"plan file {path} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"plan file {path} must hold a JSON object")
    try:
        data = flat_plan_file(data, f"plan file {path}")
        _check_batch_and_partition(plan_from_dict(data), data)
    except (TypeError, ValueError) as err:  # int("two") says neither the file nor the key
        raise ValueError(f"plan file {path}: {err}") from None
    return data


def _check_batch_and_partition(plan: SimPlan, data: dict[str, Any]) -> None:
    """The batch and the split a plan file states agree with its layout: commands that
    derive them from the layout would otherwise ignore a wrong one silently."""
    batch = data.get("global_batch")
    # a hand-written plan may leave micro_batch_size out: train derives it from the batch
    derived = "micro_batch_size" not in data or "pipelines" in data
    if batch is not None and not derived and batch != plan.global_batch_size:
        raise ValueError(
            f"global_batch={batch!r} is not dp × microbatches × micro_batch_size = "
            f"{plan.global_batch_size}; write plans with `plait plan --out`"
        )
    sizes = data.get("partition")
    if sizes is None:
        return
    layers = data.get("model", {}).get("layers")
    if isinstance(layers, int) and sum(sizes) != layers + 2:
        raise ValueError(
            f"partition={sizes!r} must add up to the model's {layers + 2} blocks (layers + 2)"
        )
