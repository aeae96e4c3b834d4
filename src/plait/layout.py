"""Where each rank sits: the named-axis `Layout` of a world of workers, its views, and its groups.

Pure arithmetic (no torch), shared by the runtime mesh (`plait.mesh`), the simulator's plan
(`plait.sim.SimPlan`), the planner and the configuration (`plait.config.ParallelPlan`), so
that a layout is simulated and trained with the same ranks in the same groups.

**Axes.** The world is the product of five named axes (`AXES`, outermost first): `pp`
(pipeline stages), `dp_replicate` (replicas that all-reduce their gradients),
`dp_shard` (ranks that shard parameters, gradients and optimizer state: ZeRO/FSDP), `cp`
(context parallelism: ranks that split each sequence into zigzag chunks and run causal
attention as a ring, `plait.parallel.context`; any degree whose 2·cp chunks divide the
sequence, gradients reduced over dp × cp by `plait.mesh`) and `tp` (tensor parallelism).
A new axis is one entry here and one in `_TOKENS`.

**Rank order.** A rank order names the three user-facing axes innermost first: under
"tp-dp-pp" (Megatron-LM's order, the default) tensor-parallel ranks are consecutive, then
data-parallel, with pipeline stages outermost. Each token stands for adjacent axes
(`_TOKENS`): "dp" for dp_shard inside dp_replicate, "tp" for tp inside cp, so that with
dp_replicate = cp = 1 every rank sits where it sat before those axes existed.

**Views** are axes that are no factor of the world. Flattened: `dp` = dp_replicate ×
dp_shard (index = replicate_index · dp_shard + shard_index), the data-parallel group.
Borrowed: expert parallelism, as in torchtitan's `ParallelDims` (with etp=1), reads the
dp × cp × tp ranks of a pipeline stage (tp innermost) as one axis, and that axis as
`edp` × `ep` with ep innermost: the `ep` ranks of one ep group hold different experts and
exchange tokens by all-to-all; the `edp` ranks of one expert-data-parallel group hold the
same experts and reduce their gradients. Hence ep must divide dp × cp × tp. Experts are
not sharded by tp: under tp > 1 the tensor-parallel ranks of a replica split the MoE
layer's tokens among them instead (`plait.parallel.experts.TokenSplit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import permutations
from math import prod

__all__ = [
    "AXES",
    "BATCH_AXES",
    "RANK_ORDERS",
    "VIEWS",
    "Layout",
    "check_ep",
    "check_rank_order",
    "expert_index",
    "expert_replicas",
    "resolve_dp",
]

AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# the axes a rank order names, and the axes each stands for (innermost first)
_TOKENS: dict[str, tuple[str, ...]] = {
    "tp": ("tp", "cp"),
    "dp": ("dp_shard", "dp_replicate"),
    "pp": ("pp",),
}
RANK_ORDERS: tuple[str, ...] = tuple("-".join(p) for p in permutations(("tp", "dp", "pp")))
# flattened views: the axes they join, outermost first
_FLAT: dict[str, tuple[str, ...]] = {"dp": ("dp_replicate", "dp_shard")}
# the axes expert parallelism borrows (outermost first; tp innermost)
_BORROWED: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp")
VIEWS: tuple[str, ...] = (*_FLAT, "ep", "edp")
# the axes whose ranks take different samples of a batch (dim 0); cp splits dim 1
BATCH_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard")


def check_rank_order(rank_order: str) -> None:
    if rank_order not in RANK_ORDERS:
        raise ValueError(
            f"rank_order={rank_order!r} is unknown: use one of {list(RANK_ORDERS)} "
            "(axes innermost first)"
        )


def expert_replicas(dp: int, tp: int, ep: int) -> int:
    """The ranks holding each expert (the expert-data-parallel degree): dp·tp / ep, since
    ep borrows its ranks from the dp × tp ranks of a stage and experts are not sharded by
    tp (its ranks split the tokens instead)."""
    return dp * tp // ep


def check_ep(ep: int, dp: int, tp: int = 1) -> None:
    """Raise ValueError unless `ep` borrows a whole number of expert groups from dp × tp."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep={ep!r} must be a positive integer")
    if (dp * tp) % ep:
        fits = [d for d in range(1, dp * tp + 1) if dp * tp % d == 0]
        raise ValueError(
            f"ep={ep} does not divide dp × tp = {dp} × {tp}: expert parallelism borrows "
            f"data- and tensor-parallel ranks (it is not another factor of the world), so use "
            f"ep in {fits} or a dp × tp that ep divides"
        )


def expert_index(dp_index: int, ep: int, *, tp_index: int = 0, tp: int = 1) -> tuple[int, int]:
    """(edp_index, ep_index) of a (data, tensor)-parallel coordinate: tp innermost, then
    ep, so an ep group holds neighbouring ranks (dp_index · tp + tp_index = edp_index · ep
    + ep_index)."""
    return divmod(dp_index * tp + tp_index, ep)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The degrees of the named axes, their rank order, and the expert-parallel degree."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    rank_order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{axis}={value!r} must be a positive integer")
        check_rank_order(self.rank_order)
        check_ep(self.ep, self.degree("dp"), self.cp * self.tp)

    @property
    def size(self) -> int:
        """The number of ranks (the product of the axes; views add none)."""
        return prod(self.degree(a) for a in AXES)

    @property
    def order(self) -> tuple[str, ...]:
        """Every axis, innermost first, as `rank_order` places them."""
        return tuple(a for token in self.rank_order.split("-") for a in _TOKENS[token])

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes whose ranks take different samples of a batch, outermost first."""
        return BATCH_AXES

    def degree(self, axis: str) -> int:
        """The degree of an axis or a view."""
        if axis in AXES:
            return int(getattr(self, axis))
        if axis in _FLAT:
            return prod(self.degree(a) for a in _FLAT[axis])
        if axis == "ep":
            return self.ep
        if axis == "edp":
            return prod(self.degree(a) for a in _BORROWED) // self.ep
        raise ValueError(f"axis {axis!r} is unknown: use one of {[*AXES, *VIEWS]}")

    def global_rank(self, coords: Mapping[str, int]) -> int:
        """The rank at `coords` (axis → index; missing axes at 0). `dp` may stand for
        dp_replicate and dp_shard (its flattened index)."""
        full = dict(coords)
        if "dp" in full:
            if {"dp_replicate", "dp_shard"} & full.keys():
                raise ValueError("give dp or dp_replicate/dp_shard coordinates, not both")
            full["dp_replicate"], full["dp_shard"] = divmod(full.pop("dp"), self.dp_shard)
        unknown = set(full) - set(AXES)
        if unknown:
            raise ValueError(f"coordinates {sorted(unknown)} are no axes of {list(AXES)}")
        rank = 0
        for axis, (stride, size) in self._strides.items():
            i = full.get(axis, 0)
            if not 0 <= i < size:
                raise ValueError(f"{axis} index {i} is outside 0..{size - 1}")
            rank += i * stride
        return rank

    @cached_property
    def _strides(self) -> dict[str, tuple[int, int]]:
        """Per axis, innermost first: (the ranks between neighbours along it, its degree).
        A rank is the sum of its coordinates times their strides; the planner and the
        simulator walk the groups of thousands of layouts' ranks."""
        out, stride = {}, 1
        for axis in self.order:
            out[axis] = (stride, self.degree(axis))
            stride *= self.degree(axis)
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """The index of `rank` on every axis (not the views: see `index`)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the layout's 0..{self.size - 1}")
        out: dict[str, int] = {}
        for axis, (_, size) in self._strides.items():
            rank, out[axis] = divmod(rank, size)
        return {a: out[a] for a in AXES}

    def index(self, axis: str, rank: int) -> int:
        """The index of `rank` along an axis or a view."""
        at = self.coords(rank)
        if axis in AXES:
            return at[axis]
        if axis in _FLAT:
            return _flat_index(self, _FLAT[axis], at)
        if axis in ("ep", "edp"):
            edp_index, ep_index = divmod(_flat_index(self, _BORROWED, at), self.ep)
            return ep_index if axis == "ep" else edp_index
        raise ValueError(f"axis {axis!r} is unknown: use one of {[*AXES, *VIEWS]}")

    def ranks(self, axis: str, rank: int) -> list[int]:
        """The group of `rank` along an axis or a view, in index order."""
        at = self.coords(rank)
        if axis in AXES:
            stride, size = self._strides[axis]
            first = rank - at[axis] * stride
            return list(range(first, first + size * stride, stride))
        if axis in _FLAT:
            return _flat_group(self, _FLAT[axis], at, rank, range(self.degree(axis)))
        flat = _flat_index(self, _BORROWED, at)
        if axis == "ep":
            members = range(flat - flat % self.ep, flat - flat % self.ep + self.ep)
        elif axis == "edp":
            members = range(flat % self.ep, self.degree("dp") * self.cp * self.tp, self.ep)
        else:
            raise ValueError(f"axis {axis!r} is unknown: use one of {[*AXES, *VIEWS]}")
        return _flat_group(self, _BORROWED, at, rank, members)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along an axis or a view, ordered by their lowest rank."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.size):
            seen.setdefault(tuple(self.ranks(axis, rank)), None)
        return sorted((list(g) for g in seen), key=min)

    def batch_shard(self, rank: int) -> tuple[int, int]:
        """(index, count): `rank` takes slice `index` of `count` equal slices of a batch."""
        return _flat_index(self, self.batch_axes, self.coords(rank)), self.degree("dp")


def _flat_index(layout: Layout, axes: tuple[str, ...], at: Mapping[str, int]) -> int:
    """The index of coordinates `at` on the axes `axes` read as one (the last innermost)."""
    index = 0
    for axis in axes:
        index = index * layout.degree(axis) + at[axis]
    return index


def _flat_group(
    layout: Layout, axes: tuple[str, ...], at: Mapping[str, int], rank: int, members: range
) -> list[int]:
    """The ranks at flat indices `members` of `axes`, the other axes as `rank`'s (whose
    coordinates are `at`)."""
    strides = layout._strides
    inner = [strides[axis] for axis in reversed(axes)]
    base = rank - sum(at[axis] * strides[axis][0] for axis in axes)
    out = []
    for flat in members:
        here = base
        for stride, size in inner:
            flat, i = divmod(flat, size)
            here += i * stride
        out.append(here)
    return out


def resolve_dp(
    dp: int, dp_replicate: int | None, dp_shard: int | None, zero: int
) -> tuple[int, int, int, int]:
    """(dp, dp_replicate, dp_shard, zero) of a plan's data-parallel settings.

    Neither axis given: ZeRO-3 is FSDP over all of dp (dp_shard = dp), ZeRO 0/1/2 keep
    dp replicas (dp_replicate = dp; stages 1 and 2 shard over that data-parallel group as
    they always did). Given axes fix dp as their product (dp = 1 reads as unset) and the
    other axis as dp / the given one. dp_shard > 1 is FSDP: ZeRO 0 becomes 3, and with
    dp_replicate > 1 (HSDP, FSDP2 on the 2-D mesh) ZeRO-1 has no place."""
    if dp_replicate is None and dp_shard is None:
        return (dp, 1, dp, zero) if zero == 3 else (dp, dp, 1, zero)
    for name, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name}={value!r} must be a positive integer, or unset")
    given = (dp_replicate or 1) * (dp_shard or 1)
    if dp != 1 and dp % given:
        raise ValueError(
            f"dp={dp} is not a multiple of dp_replicate × dp_shard = {dp_replicate or 1} × "
            f"{dp_shard or 1}: give dp = dp_replicate × dp_shard, or drop dp"
        )
    rest = dp // given if dp != 1 else 1
    rep = dp_replicate if dp_replicate is not None else rest
    shard = dp_shard if dp_shard is not None else rest
    if dp != 1 and rep * shard != dp:
        raise ValueError(
            f"dp={dp} but dp_replicate × dp_shard = {rep} × {shard} = {rep * shard}: "
            "give dp = dp_replicate × dp_shard, or drop dp"
        )
    if shard > 1 and zero == 0:
        zero = 3
    if shard > 1 and rep > 1 and zero == 1:
        raise ValueError(
            f"zero=1 with dp_replicate={rep} × dp_shard={shard}: hybrid sharding runs FSDP2 "
            "on the 2-D (replicate, shard) mesh; use zero=3 (or 2), or dp_replicate=1"
        )
    if shard == 1 and zero == 3 and rep > 1:
        raise ValueError(
            f"zero=3 with dp_shard=1 shards over nothing: set dp_shard > 1 (FSDP over it), "
            f"or zero 0-2 for {rep} replicas"
        )
    return rep * shard, rep, shard, zero
