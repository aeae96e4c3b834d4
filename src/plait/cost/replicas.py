"""Which ranks share a rank's gradients and model state, as the cost model reads a layout.

Data parallelism replicates a rank's parameters over the `dp` ranks of its data-parallel
group (axis "dp"): its gradients are reduced over them and ZeRO shards its model state
over them (Rajbhandari et al. 2020). Expert parallelism borrows its `ep` ranks from the
dp × tp ranks of a pipeline stage (`plait.layout`), so an expert is replicated on
dp·tp / ep of them (axis "edp"): its gradients are reduced, and its state sharded, over
those instead. The gradient-sync and model-state formulas (`plait.cost.moe`,
`plait.cost.compress`) read the layout through `DataLayout`, and price a collective with
the degree and link `plait.cost.comm.AxisLinks` gives its axis, whose degrees
`sync_degrees` derives from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from plait.layout import expert_replicas

__all__ = ["DataDegrees", "DataLayout", "expert_dp_degree", "sync_degrees"]


class DataLayout(Protocol):
    """What of a layout decides how a rank's gradients are reduced and its model state
    sharded: the data-, tensor- and expert-parallel degrees and the ZeRO stage. Satisfied
    by `plait.config.ParallelPlan` and `plait.sim.SimPlan`, and by `DataDegrees` where
    there is no plan; named here rather than imported for the reason `plait.cost.Layout`
    gives (`cost` stays below `config`)."""

    @property
    def dp(self) -> int: ...

    @property
    def tp(self) -> int: ...

    @property
    def ep(self) -> int: ...

    @property
    def zero(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class DataDegrees:
    """A `DataLayout` given by its numbers (default: one rank, no ZeRO), for callers that
    price a layout without a plan."""

    dp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r} must be 0, 1, 2 or 3")
        if (self.dp * self.tp) % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp × tp = {self.dp * self.tp}: expert "
                "parallelism borrows its ranks from them; choose ep dividing dp × tp"
            )


def expert_dp_degree(layout: DataLayout) -> int:
    """Ranks holding the same experts (the degree of axis "edp"):
    `plait.layout.expert_replicas` of the layout. ep = dp·tp: one copy of each expert per
    stage, nothing to reduce."""
    return expert_replicas(layout.dp, layout.tp, layout.ep)


def sync_degrees(layout: DataLayout) -> dict[str, int]:
    """Degrees of the axes gradients are reduced over, for `plait.cost.comm.AxisLinks`:
    "dp" for the dense parameters, "edp" for the experts."""
    return {"dp": layout.dp, "edp": expert_dp_degree(layout)}
