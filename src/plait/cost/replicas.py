"""Which ranks share a rank's gradients and model state, as the cost model reads a layout.

Data parallelism replicates a rank's parameters over the `dp` ranks of its data-parallel
group (axis "dp"): its gradients are reduced over them and ZeRO shards its model state
over them (Rajbhandari et al. 2020). Expert parallelism borrows its `ep` ranks from the
dp × tp ranks of a pipeline stage (`plait.layout`), so an expert is replicated on
dp·tp / ep of them (axis "edp"): its gradients are reduced, and its state sharded, over
those instead. Under hybrid sharding (HSDP: dp_replicate and dp_shard > 1) the state is
sharded over the dp_shard ranks only and replicated across the dp_replicate groups
(`shard_degree`). Context parallelism's cp ranks of a replica hold the same weights, so
the dense gradients are reduced, and ZeRO shards, over dp × cp (the runtime's flattened
`dp_cp` group; HSDP with cp is refused). The gradient-sync and model-state formulas
(`plait.cost.moe`, `plait.cost.compress`) read the layout through `DataLayout`, and price
a collective with the degree and link `plait.cost.comm.AxisLinks` gives its axis, whose
degrees `sync_degrees` derives from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from plait.layout import Layout, expert_replicas

__all__ = [
    "DataDegrees",
    "DataLayout",
    "expert_dp_degree",
    "hybrid_shard",
    "shard_degree",
    "sync_degrees",
]


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

    @property
    def layout(self) -> Layout: ...


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

    @property
    def layout(self) -> Layout:
        """The named axes of these degrees: ZeRO-3 shards over all of dp (dp_shard = dp),
        lower stages keep dp replicas, as `plait.layout.resolve_dp` reads a plan."""
        rep, shard = (1, self.dp) if self.zero == 3 else (self.dp, 1)
        return Layout(dp_replicate=rep, dp_shard=shard, tp=self.tp, ep=self.ep)


def expert_dp_degree(layout: DataLayout) -> int:
    """Ranks holding the same experts (the degree of axis "edp"):
    `plait.layout.expert_replicas` of the layout. ep = dp·tp: one copy of each expert per
    stage, nothing to reduce."""
    return expert_replicas(layout.dp, layout.tp, layout.ep)


def hybrid_shard(layout: DataLayout) -> int:
    """dp_shard under hybrid sharding (dp_replicate and dp_shard > 1 with ZeRO-2/3: FSDP2
    on the 2-D mesh), else 1."""
    named = layout.layout
    hybrid = named.dp_replicate > 1 and named.dp_shard > 1 and layout.zero >= 2
    return named.dp_shard if hybrid else 1


def shard_degree(layout: DataLayout) -> int:
    """The ranks ZeRO shards the dense model state over: dp_shard under hybrid sharding,
    else every data-parallel rank (and context-parallel one: dp × cp)."""
    return hybrid_shard(layout) if hybrid_shard(layout) > 1 else layout.dp * layout.layout.cp


def sync_degrees(layout: DataLayout) -> dict[str, int]:
    """Degrees of the axes gradients are reduced over, for `plait.cost.comm.AxisLinks`:
    "dp" for the dense parameters (dp × cp ranks; its dp_replicate and dp_shard parts
    under hybrid sharding), "edp" for the experts."""
    named = layout.layout
    return {
        "dp": layout.dp * named.cp,
        "dp_replicate": named.dp_replicate,
        "dp_shard": named.dp_shard,
        "edp": expert_dp_degree(layout),
    }
