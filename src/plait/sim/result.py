"""What a simulation predicts: per-rank timeline, step time, bubble, memory, throughput.

The same shapes (a label such as ``2F0`` with start and end per rank) come out of the
runtime's measurements, so predicted and measured timelines line up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from plait.schedule import COMM_OPS, WEIGHT_OPS, Op, Replay
from plait.sim.plan import SimPlan

__all__ = ["MemoryOverflow", "MemoryUse", "RankReport", "SimResult", "TimelineEvent"]

_GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One span on a pipeline rank: `kind` is "compute", "comm" or "optimizer" (updates
    and weight copies)."""

    rank: int
    label: str
    start: float
    end: float
    kind: str


@dataclass(frozen=True)
class MemoryUse:
    """Peak bytes of one rank: model state, activations of in-flight micro-batches, the
    transient working set (activations rebuilt by recomputation, ZeRO-3 gathered weights)
    and the weight copies an asynchronous schedule keeps (stashed or predicted versions)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    weight_copies: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.transient
            + self.weight_copies
        )


@dataclass(frozen=True)
class RankReport:
    """Where one pipeline rank's step time goes (seconds) and what memory it needs."""

    pp_rank: int
    global_rank: int  # of its first tensor- and data-parallel replica
    device: str
    compute_s: float  # forward and backward work, recomputation included
    # tensor-parallel collectives inside blocks (and ZeRO-3 gathers), on the critical path
    tp_comm_s: float
    p2p_s: float  # time this rank's sends occupy their channels (overlapped with compute)
    dp_comm_s: float  # gradient reduction, overlapped with later backwards where possible
    optimizer_s: float
    end_s: float  # when this rank's optimizer step ends
    memory: MemoryUse
    capacity_bytes: float
    ep_comm_s: float = 0.0  # the experts' token all-to-alls, on the critical path
    cp_comm_s: float = 0.0  # the cp ring's transfers attention does not hide

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.p2p_s + self.dp_comm_s + self.ep_comm_s + self.cp_comm_s


@dataclass(frozen=True)
class MemoryOverflow:
    """A rank whose peak memory exceeds its device's capacity."""

    rank: int
    pp_rank: int
    needed_bytes: float
    capacity_bytes: float

    @property
    def excess_bytes(self) -> float:
        return self.needed_bytes - self.capacity_bytes

    def __str__(self) -> str:
        return (
            f"rank {self.rank} (pipeline rank {self.pp_rank}) needs "
            f"{self.needed_bytes / _GIB:.2f} GiB but has {self.capacity_bytes / _GIB:.2f} GiB: "
            f"{self.excess_bytes / _GIB:.2f} GiB over"
        )


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """The prediction for one step of `plan`.

    `bubble_fraction` is the idle share of the pipeline ranks during the pipelined compute
    (imbalance included); `comm_share` the mean share of the step a rank spends moving
    data, hidden or not (Table 2 of the data-movement studies); `mfu` model FLOPs (no
    recomputation) over step time × the plan's devices' peak FLOP/s (Chowdhery et al. 2022).
    """

    plan: SimPlan
    step_time_s: float
    pipeline_time_s: float
    bubble_fraction: float
    ranks: tuple[RankReport, ...]
    overflows: tuple[MemoryOverflow, ...]
    model_flops: float  # per step, all ranks
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    comm_share: float
    replay: Replay = field(repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return not self.overflows

    @property
    def all_to_all_share(self) -> float:
        """The mean share of the step a pipeline rank spends in the experts' all-to-alls."""
        if self.step_time_s <= 0:
            return 0.0
        return sum(r.ep_comm_s for r in self.ranks) / (len(self.ranks) * self.step_time_s)

    @property
    def peak_memory_bytes(self) -> tuple[float, ...]:
        """Per pipeline rank."""
        return tuple(r.memory.total for r in self.ranks)

    def memory_report(self) -> str:
        """One line per rank that does not fit, worst first; or that all fit."""
        if self.fits:
            return "every rank fits in its device memory"
        worst = sorted(self.overflows, key=lambda o: -o.excess_bytes)
        return "\n".join(str(o) for o in worst)

    @cached_property
    def timeline(self) -> tuple[tuple[TimelineEvent, ...], ...]:
        """Per pipeline rank, in time order: compute, sends, gradient reductions, optimizer
        steps and weight copies (for an asynchronous schedule, of the whole replayed run).
        Built on first use (it has one entry per action)."""
        per_rank: list[list[TimelineEvent]] = []
        for rank, events in enumerate(self.replay.events):
            row = [
                TimelineEvent(rank, str(e.action), e.start, e.end, _kind(e.action.op))
                for e in events
                if e.action.op not in (Op.RECV_F, Op.RECV_B)
            ]
            row.sort(key=lambda e: (e.start, e.end))
            per_rank.append(row)
        return tuple(tuple(row) for row in per_rank)


def _kind(op: Op) -> str:
    if op in COMM_OPS:
        return "comm"
    return "optimizer" if op in WEIGHT_OPS or op is Op.UPDATE else "compute"
