"""Small parts of a plan: recomputation modes, dtypes, one pipeline of a heterogeneous plan,
and the layout a plan's degrees name (built once per distinct plan)."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any

from plait.config.fields import check_types, positive
from plait.layout import Layout, resolve_dp

__all__ = [
    "DP_AXES",
    "DTYPES",
    "RECOMPUTE",
    "PipelineSpec",
    "Recompute",
    "layout_of",
    "pipeline_specs",
]

Recompute = typing.Literal["none", "selective", "full"]
RECOMPUTE = typing.get_args(Recompute)
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """One pipeline (HetPipe's virtual worker) of a heterogeneous plan: its blocks per
    stage (pp = len(partition) / chunks ranks), its micro-batches per step (its share of
    the batch) and the device kind of each rank (informative)."""

    partition: tuple[int, ...]
    microbatches: int
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "microbatches")
        if not self.partition or min(self.partition) < 1:
            raise ValueError(
                f"pipelines: partition={list(self.partition)} must give >= 1 block to each stage"
            )


def pipeline_specs(value: Any) -> Any:
    """`pipelines` as read from TOML/JSON (a list of objects) -> PipelineSpecs."""
    if value is None or not isinstance(value, list | tuple):
        return value
    if not all(isinstance(v, dict | PipelineSpec) for v in value):
        raise ValueError(
            f"pipelines={value!r} must be a list of objects, each with partition and microbatches"
        )
    try:
        return tuple(v if isinstance(v, PipelineSpec) else PipelineSpec(**v) for v in value)
    except TypeError as err:
        raise ValueError(f"pipelines={value!r}: {err}") from None


DP_AXES = ("dp_replicate", "dp_shard")


@functools.lru_cache(maxsize=256)
def layout_of(
    pp: int,
    dp: int,
    rep: int | None,
    shard: int | None,
    zero: int,
    cp: int,
    tp: int,
    ep: int,
    order: str,
) -> Layout:
    """A plan's layout, built once per distinct plan (the simulator asks for it per rank)."""
    _, replicate, sharded, _ = resolve_dp(dp, rep, shard, zero)
    return Layout(pp=pp, dp_replicate=replicate, dp_shard=sharded, cp=cp, tp=tp, ep=ep,
                  rank_order=order)  # fmt: skip
