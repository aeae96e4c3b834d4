"""Communication time under the alpha-beta model: point to point and collectives.

Every formula charges `latency_s` (alpha) per message step and bytes / `bandwidth_Bps`
(beta) per byte on the bottleneck link, as in Thakur, Rabenseifner and Gropp, "Optimization
of Collective Communication Operations in MPICH" (2005), and Patarasuk and Yuan's
bandwidth-optimal ring all-reduce (2009). `num_bytes` is always the size of one rank's
full buffer: the input of an all-reduce or reduce-scatter, the output of an all-gather,
the send buffer of an all-to-all.

Limits: no contention between concurrent collectives, no in-network reduction (SHARP), no
hierarchical (intra- then inter-node) algorithms: a group spanning nodes runs entirely at
the inter-node link's speed, which is pessimistic for large groups on few nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from plait.cluster import Cluster, Link
from plait.layout import AXES, VIEWS

__all__ = [
    "COLLECTIVE_AXES",
    "COLLECTIVE_KINDS",
    "AxisLinks",
    "Collective",
    "CollectiveAxis",
    "CollectiveKind",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "collective_time",
    "dp_sync_collectives",
    "dp_sync_time",
    "group_collective_time",
    "p2p_time",
    "reduce_scatter_time",
    "ring_all_reduce_time",
    "tree_all_reduce_time",
]

CollectiveKind = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]
COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


# a collective runs over the group of one axis or view of `plait.layout.Layout`, named as
# there: "dp" the data-parallel group (dp_replicate × dp_shard), "edp" the ranks holding
# the same experts (dp·tp / ep of them), "ep" those exchanging tokens
CollectiveAxis = str
COLLECTIVE_AXES: tuple[str, ...] = (*AXES, *VIEWS)


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective a block issues over the group of one parallel `axis` (tensor
    parallel by default; "ep" for the token all-to-all of experts), for one micro-batch."""

    kind: CollectiveKind
    num_bytes: float
    axis: CollectiveAxis

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {self.kind!r} is unknown; use {COLLECTIVE_KINDS}")
        if self.axis not in COLLECTIVE_AXES:
            raise ValueError(f"collective axis {self.axis!r} is unknown; use {COLLECTIVE_AXES}")
        if not self.num_bytes >= 0:
            raise ValueError(f"collective {self.kind}: num_bytes={self.num_bytes} must be >= 0")


@dataclass(frozen=True)
class AxisLinks:
    """The group a collective of each axis runs over, as the cost model sees it: its
    degree (ranks) and its link (`Cluster.group_link` of the group). An axis left out, of
    degree 1 or without a link costs nothing."""

    degrees: Mapping[str, int] = field(default_factory=dict)
    links: Mapping[str, Link | None] = field(default_factory=dict)

    def group(self, axis: str) -> tuple[int, Link | None]:
        """(degree, link) of `axis`'s group: (1, None) for an axis left out."""
        return self.degrees.get(axis, 1), self.links.get(axis)

    def hybrid_shard(self) -> int:
        """dp_shard when the data-parallel group is hybrid (dp_replicate and dp_shard > 1
        among the degrees), else 1."""
        replicate, shard = self.degrees.get("dp_replicate", 1), self.degrees.get("dp_shard", 1)
        return shard if replicate > 1 and shard > 1 else 1

    def time(self, collectives: Sequence[Collective]) -> float:
        """Seconds of `collectives`, one after another, each over its axis's group."""
        total = 0.0
        for c in collectives:
            n, link = self.group(c.axis)
            if n > 1 and link is not None:
                total += collective_time(c, n, link)
        return total


def _check(n: int, num_bytes: float) -> None:
    if n < 1:
        raise ValueError(f"a collective over n={n} ranks is meaningless; use n >= 1")
    if num_bytes < 0:
        raise ValueError(f"num_bytes={num_bytes} must be >= 0")


def p2p_time(cluster: Cluster, src: int, dst: int, num_bytes: float) -> float:
    """Seconds to send `num_bytes` from global rank `src` to `dst`: latency + bytes/bandwidth."""
    return cluster.link(src, dst).time(num_bytes)


def ring_all_reduce_time(n: int, num_bytes: float, link: Link) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): 2(n-1)/n · B/bw + 2(n-1)·alpha."""
    _check(n, num_bytes)
    if n == 1 or num_bytes == 0:
        return 0.0
    return 2 * (n - 1) / n * num_bytes / link.bandwidth_Bps + 2 * (n - 1) * link.latency_s


def tree_all_reduce_time(n: int, num_bytes: float, link: Link) -> float:
    """Pipelined binary-tree all-reduce (reduce up, broadcast down, as NCCL's double binary
    tree, Sanders et al. 2009): 2⌈log2 n⌉·alpha + 2·B/bw. Fewer latency terms than the
    ring, about the same bandwidth term for large n; the ring wins for small n."""
    _check(n, num_bytes)
    if n == 1 or num_bytes == 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * num_bytes / link.bandwidth_Bps


def all_reduce_time(
    n: int, num_bytes: float, link: Link, *, algorithm: Literal["ring", "tree", "best"] = "best"
) -> float:
    """All-reduce by `algorithm`; "best" takes the faster of ring and tree (as NCCL tunes)."""
    ring = ring_all_reduce_time(n, num_bytes, link)
    if algorithm == "ring":
        return ring
    tree = tree_all_reduce_time(n, num_bytes, link)
    if algorithm == "tree":
        return tree
    if algorithm != "best":
        raise ValueError(f"algorithm={algorithm!r} is unknown; use 'ring', 'tree' or 'best'")
    return min(ring, tree)


def reduce_scatter_time(n: int, num_bytes: float, link: Link) -> float:
    """Ring reduce-scatter of a B-byte buffer: (n-1)/n · B/bw + (n-1)·alpha."""
    _check(n, num_bytes)
    if n == 1 or num_bytes == 0:
        return 0.0
    return (n - 1) / n * num_bytes / link.bandwidth_Bps + (n - 1) * link.latency_s


def all_gather_time(n: int, num_bytes: float, link: Link) -> float:
    """Ring all-gather into a B-byte buffer: (n-1)/n · B/bw + (n-1)·alpha."""
    return reduce_scatter_time(n, num_bytes, link)


def all_to_all_time(n: int, num_bytes: float, link: Link) -> float:
    """Pairwise-exchange all-to-all of a B-byte send buffer: each rank keeps 1/n and sends
    n-1 pieces of B/n, so (n-1)/n · B/bw + (n-1)·alpha."""
    return reduce_scatter_time(n, num_bytes, link)


def collective_time(collective: Collective, n: int, link: Link) -> float:
    """Seconds one collective takes over n ranks joined by `link` (all-reduce: best of
    ring and tree)."""
    if collective.kind == "all_reduce":
        return all_reduce_time(n, collective.num_bytes, link)
    if collective.kind == "all_to_all":
        return all_to_all_time(n, collective.num_bytes, link)
    return reduce_scatter_time(n, collective.num_bytes, link)  # same cost as all-gather


def group_collective_time(cluster: Cluster, ranks: Sequence[int], collective: Collective) -> float:
    """Seconds a collective takes over global `ranks`, on the group's bottleneck link
    (`Cluster.group_link`: inter-node as soon as the group spans nodes)."""
    return collective_time(collective, len(set(ranks)), cluster.group_link(ranks))


# what data parallelism communicates per step, by ZeRO stage (Rajbhandari et al. 2020)
_DP_COLLECTIVES: dict[int, tuple[CollectiveKind, ...]] = {
    0: ("all_reduce",),
    1: ("reduce_scatter", "all_gather"),
    2: ("reduce_scatter", "all_gather"),
    3: ("reduce_scatter",),
}


def dp_sync_collectives(
    num_bytes: float, *, zero_stage: int, axis: CollectiveAxis = "dp", hybrid_shard: int = 1
) -> tuple[Collective, ...]:
    """What the gradient reduction of `num_bytes` of parameters issues over `axis` ("dp":
    the data-parallel group; "edp": the ranks holding the same experts) per step: an
    all-reduce; with ZeRO-1/2 a reduce-scatter plus the all-gather of the updated
    weights; with ZeRO-3 only the reduce-scatter (its gathers happen per micro-batch).

    `hybrid_shard` > 1 (HSDP over "dp", ZeRO-2/3: FSDP2 on the 2-D mesh): the
    reduce-scatter and gather run over "dp_shard", and each rank's 1/hybrid_shard of the
    gradients is all-reduced over "dp_replicate" (FSDP2's order)."""
    if zero_stage not in _DP_COLLECTIVES:
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if hybrid_shard > 1 and axis == "dp" and zero_stage >= 2:
        shard = [Collective(kind=k, num_bytes=num_bytes, axis="dp_shard")
                 for k in _DP_COLLECTIVES[zero_stage]]  # fmt: skip
        across = Collective(kind="all_reduce", num_bytes=num_bytes / hybrid_shard,
                            axis="dp_replicate")  # fmt: skip
        return (shard[0], across, *shard[1:])
    return tuple(
        Collective(kind=k, num_bytes=num_bytes, axis=axis) for k in _DP_COLLECTIVES[zero_stage]
    )


def dp_sync_time(
    num_bytes: float, *, zero_stage: int, links: AxisLinks, axis: CollectiveAxis = "dp"
) -> float:
    """Seconds of `dp_sync_collectives` over the group `links` gives `axis` (nothing on
    one rank); hybrid sharding when `links` gives dp_replicate and dp_shard > 1."""
    return links.time(
        dp_sync_collectives(
            num_bytes, zero_stage=zero_stage, axis=axis, hybrid_shard=links.hybrid_shard()
        )
    )
