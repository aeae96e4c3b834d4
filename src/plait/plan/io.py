"""A chosen plan as plain JSON, read back by `plait train --plan` and `plait simulate --plan`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from plait.config import ParallelPlan
from plait.plan.search import RankedPlan
from plait.sim import SimPlan

__all__ = [
    "PLAN_KEYS",
    "SIM_FIELDS",
    "SIM_ONLY",
    "TRAIN_BATCH_KEYS",
    "check_trainable",
    "parallel_plan_of",
    "plan_from_dict",
    "plan_to_dict",
    "read_plan",
    "write_plan",
]

# the keys `plait.config.ParallelPlan` takes (its field names), plus the batch layout
PLAN_KEYS = (
    "dp", "tp", "pp", "ep", "schedule", "microbatches", "chunks", "zero", "recompute",
    "sequence_parallel", "dtype", "partition", "micro_batch_size", "global_batch", "rank_order",
    "compress", "pipelines", "wsp_staleness", "wsp_wave",
)  # fmt: skip

# plan-file key -> the `SimPlan` field that holds it; None: the key is not a SimPlan field
# (the partition is the `RankedPlan`'s, the global batch derives from the layout)
SIM_FIELDS: dict[str, str | None] = {
    "dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "schedule": "schedule",
    "microbatches": "num_microbatches", "chunks": "num_chunks", "zero": "zero_stage",
    "recompute": "recompute", "sequence_parallel": "sequence_parallel", "dtype": "dtype",
    "partition": None, "micro_batch_size": "micro_batch_size", "global_batch": None,
    "rank_order": "rank_order", "compress": "compress",
    # the simulator takes heterogeneous pipelines from the planner's `HeteroPlan`, and
    # does not replay WSP's waves
    "pipelines": None, "wsp_staleness": None, "wsp_wave": None,
}  # fmt: skip
# SimPlan fields a plan file keeps elsewhere: the sequence length under "model", the
# optimizer in the training config (it weighs only in the simulator's memory)
SIM_ONLY = {"seq_len": "model.seq_len", "optimizer": "the training config's optimizer"}
# plan-file keys that are no `ParallelPlan` field: the batch, which `plait train` sets
TRAIN_BATCH_KEYS = ("micro_batch_size", "global_batch")


_KINDS: dict[str, type] = {
    **dict.fromkeys(("dp", "tp", "pp", "ep", "microbatches", "chunks", "zero", "micro_batch_size",
                     "global_batch", "wsp_staleness", "wsp_wave"), int),
    **dict.fromkeys(("schedule", "recompute", "dtype", "rank_order", "compress"), str),
    "sequence_parallel": bool,
    "model": dict,
}  # fmt: skip
_KIND_NAMES = {int: "an integer", str: "a string", bool: "true or false", dict: "an object"}


def plan_to_dict(
    ranked: RankedPlan, *, model: dict[str, Any] | None = None, cluster: str | None = None
) -> dict[str, Any]:
    """The plan (layout and batch) and what the simulator predicts for it."""
    p = ranked.plan
    out: dict[str, Any] = {
        "dp": p.dp, "tp": p.tp, "pp": p.pp, "ep": p.ep, "schedule": p.schedule,
        "microbatches": p.num_microbatches, "chunks": p.num_chunks, "zero": p.zero_stage,
        "recompute": p.recompute, "sequence_parallel": p.sequence_parallel, "dtype": p.dtype,
        "partition": list(ranked.sizes), "micro_batch_size": p.micro_batch_size,
        "global_batch": p.global_batch_size, "rank_order": p.rank_order,
        "compress": p.compress,
        "predicted": {
            "step_time_s": ranked.step_time_s, "tokens_per_s": ranked.tokens_per_s,
            "mfu": ranked.mfu, "bubble_fraction": ranked.bubble_fraction,
            "comm_share": ranked.comm_share, "peak_memory_bytes": list(ranked.peak_memory_bytes),
            "headroom_bytes": ranked.headroom_bytes,
        },
    }  # fmt: skip
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


def plan_from_dict(data: dict[str, Any]) -> SimPlan:
    """The `SimPlan` a plan file describes (its partition stays in the dict)."""
    missing = [k for k in ("dp", "tp", "pp", "schedule", "microbatches") if k not in data]
    if missing:
        raise ValueError(f"plan file lacks keys {missing}; write plans with `plait plan --out`")
    for key, kind in _KINDS.items():  # int() would read "2" and 2.7 as counts, bool() "no"
        value = data.get(key)
        wrong = not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)
        if value is not None and wrong:
            raise ValueError(f"{key}={value!r} must be {_KIND_NAMES[kind]}")
    return SimPlan(
        dp=int(data["dp"]), tp=int(data["tp"]), pp=int(data["pp"]), ep=int(data.get("ep", 1)),
        schedule=str(data["schedule"]), num_microbatches=int(data["microbatches"]),
        micro_batch_size=int(data.get("micro_batch_size", 1)),
        num_chunks=int(data.get("chunks", 1)), recompute=data.get("recompute", "none"),
        zero_stage=int(data.get("zero", 0)), dtype=str(data.get("dtype", "bf16")),
        sequence_parallel=bool(data.get("sequence_parallel", False)),
        seq_len=int(data.get("model", {}).get("seq_len", 1)),
        rank_order=str(data.get("rank_order", "tp-dp-pp")),
        compress=str(data.get("compress", "none")),
    )  # fmt: skip


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
    keys = [f.name for f in dataclasses.fields(ParallelPlan)]
    fields = {k: data[k] for k in keys if data.get(k) is not None}
    first = (data.get("pipelines") or [None])[0]
    if isinstance(first, dict) and isinstance(first.get("microbatches"), int):
        # each pipeline runs its own count; the top-level one (the planner's equal split)
        # becomes the first pipeline's, by which the logs count rank 0's micro-batches
        fields["microbatches"] = data["pipelines"][0].get(
            "microbatches", fields.get("microbatches")
        )
    return ParallelPlan(**fields)


def write_plan(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


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
    stages = plan.pp * plan.num_chunks
    ok = isinstance(sizes, list) and all(isinstance(n, int) and n >= 1 for n in sizes)
    if not ok or len(sizes) != stages:
        raise ValueError(
            f"partition={sizes!r} must give >= 1 block to each of the {stages} stages "
            f"(pp={plan.pp} × chunks={plan.num_chunks})"
        )
    layers = data.get("model", {}).get("layers")
    if isinstance(layers, int) and sum(sizes) != layers + 2:
        raise ValueError(
            f"partition={sizes!r} must add up to the model's {layers + 2} blocks (layers + 2)"
        )
