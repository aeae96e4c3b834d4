"""The plan the simulator evaluates: a layout and the shape of the work it prices.

There is one plan type: `plait.config.ParallelPlan` holds the layout (degrees, rank
order, schedule, partition, memory and communication options) that training, plan files,
the planner and the simulator share. `SimPlan` is that layout plus what the simulator
needs to price a step and training takes from its own config: samples per micro-batch,
tokens per sample and the optimizer whose state it counts. Global ranks follow
Megatron-LM's order by default, tensor-parallel ranks innermost (neighbours on one node),
then data-parallel, then pipeline outermost.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from plait.cluster import normalize_dtype
from plait.config import ParallelPlan
from plait.cost import Optimizer
from plait.layout import RANK_ORDERS

__all__ = ["RANK_ORDERS", "SimPlan"]


@dataclass(frozen=True, kw_only=True)
class SimPlan(ParallelPlan):
    """A `ParallelPlan` with the batch shape: `schedule` over `microbatches` of
    `micro_batch_size` samples (`seq_len` tokens each) per data-parallel rank and step.

    The simulator prices layouts training does not run (tf32 or fp8, asynchronous
    schedules with tp, ZeRO with one replica), so the runtime's refusals
    (`ParallelPlan._check_trainable`) are left to training; its defaults describe a
    one-pipeline bf16 job rather than training's two-stage fp32 one."""

    pp: int = field(default=1)
    dtype: str = field(default="bf16")
    micro_batch_size: int = field(default=1)
    seq_len: int = field(default=1)
    optimizer: Optimizer = field(default="adam")
    # micro-batches of one step over all replicas when they do not divide equally among
    # them (0: dp × microbatches). The replicas then take shares differing by one, the
    # first ones the larger, and `microbatches` is the largest share: the replica that
    # sets the step. Training runs it as pipelines of their own shares
    # (`ParallelPlan.pipelines`).
    total_microbatches: int = field(default=0)
    # one process issues every pipeline stage's work (torchgpipe's runner: a thread per
    # device under one interpreter), so the host time of all stages' actions is serialised
    # (`plait.sim.replica`); False: a process per rank, as plait's runtime runs
    single_process: bool = field(default=False)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        super().__post_init__()
        for name in ("micro_batch_size", "seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        total = self.total_microbatches
        if total and not (self.dp <= total and -(-total // self.dp) == self.microbatches):
            raise ValueError(
                f"total_microbatches={total} cannot be shared over dp={self.dp} replicas "
                f"of at most microbatches={self.microbatches} each: give a total between "
                f"{max(self.dp, self.dp * (self.microbatches - 1) + 1)} and "
                f"{self.dp * self.microbatches}, or 0 for equal shares"
            )

    def to_dict(self) -> dict[str, Any]:
        """Every field, less `total_microbatches` when the shares are equal and
        `single_process` when False (as they were before these existed)."""
        out = super().to_dict()
        if not self.total_microbatches:
            del out["total_microbatches"]
        if not self.single_process:
            del out["single_process"]
        return out

    @property
    def shares(self) -> tuple[int, ...]:
        """Micro-batches of each data-parallel replica per step (each pipeline's own when
        the plan has `pipelines`)."""
        if self.pipelines is not None:
            return tuple(p.microbatches for p in self.pipelines)
        if not self.total_microbatches:
            return (self.microbatches,) * self.dp
        low, extra = divmod(self.total_microbatches, self.dp)
        return tuple(low + (d < extra) for d in range(self.dp))

    @classmethod
    def of(cls, layout: ParallelPlan, **shape: Any) -> SimPlan:
        """`layout` with every one of its fields, and the batch shape `shape` (keywords
        `micro_batch_size`, `seq_len`, `optimizer`)."""
        return cls(**{f.name: getattr(layout, f.name) for f in fields(ParallelPlan)}, **shape)

    @property
    def depths(self) -> tuple[int, ...]:
        """Ranks of each pipeline: its own with `pipelines`, else pp for every replica."""
        if self.pipelines is None:
            return (self.pp,) * self.dp
        return tuple(len(p.partition) // self.chunks for p in self.pipelines)

    def global_rank(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> int:
        """As `ParallelPlan.global_rank`, except that pipelines of different depths take
        consecutive ranks (`plait.pipelines.pipeline_layout`): pipeline d's stage rank s
        is rank sum(depths[:d]) + s."""
        depths = self.depths if self.pipelines is not None else ()
        if len(set(depths)) <= 1:
            return super().global_rank(pp_rank, dp_rank, tp_rank)
        if not (0 <= pp_rank < depths[dp_rank] and tp_rank == 0):
            raise ValueError(
                f"pipeline {dp_rank} has ranks 0..{depths[dp_rank] - 1} (tp=1), not "
                f"pp_rank={pp_rank} tp_rank={tp_rank}"
            )
        return sum(depths[:dp_rank]) + pp_rank

    def parallel_plan(self) -> ParallelPlan:
        """The layout alone, as training takes it (checked as training checks it)."""
        return ParallelPlan(**{f.name: getattr(self, f.name) for f in fields(ParallelPlan)})

    def _check_trainable(self) -> None:
        pass

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all data-parallel ranks."""
        return sum(self.shares) * self.micro_batch_size
