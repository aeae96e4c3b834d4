"""Where each rank sits in the layout: rank orders, global ranks of coordinates, the expert axis.

Pure arithmetic (no torch), shared by the runtime mesh (`plait.mesh`), the simulator's plan
(`plait.sim.SimPlan`) and the configuration (`plait.config.ParallelPlan`), so that a layout
is simulated and trained with the same ranks in the same groups.

The world is pp × dp × tp ranks. A rank order names the axes innermost first: under
"tp-dp-pp" (Megatron-LM's order, the default) tensor-parallel ranks are consecutive, then
data-parallel, with pipeline stages outermost.

Expert parallelism is not another factor of the world, as in torchtitan's `ParallelDims`
(with etp=1): it borrows the ranks of data and tensor parallelism. Within a pipeline rank
the dp × tp ranks are read in (dp_index, tp_index) order, tp innermost, as one axis of
dp · tp ranks, and that axis as edp × ep with ep innermost
(dp_index · tp + tp_index = edp_index · ep + ep_index): the `ep` ranks of one ep group
hold different experts and exchange tokens by all-to-all; the `edp = dp · tp / ep` ranks
of one expert-data-parallel group hold the same experts and reduce their gradients.
Hence ep must divide dp × tp. Experts are not sharded by tp: under tp > 1 the tensor-
parallel ranks of a replica split the MoE layer's tokens among them instead
(`plait.parallel.experts.TokenSplit`). Torchtitan also lets ep borrow context-parallel
ranks; plait has no cp.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import permutations

__all__ = [
    "AXES",
    "RANK_ORDERS",
    "check_ep",
    "check_rank_order",
    "expert_index",
    "expert_replicas",
    "global_rank",
    "rank_grid",
]

AXES: tuple[str, ...] = ("tp", "dp", "pp")
RANK_ORDERS: tuple[str, ...] = tuple("-".join(p) for p in permutations(AXES))


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


def global_rank(rank_order: str, degrees: Mapping[str, int], index: Mapping[str, int]) -> int:
    """The global rank of the coordinate `index` (axis → index) under `rank_order`."""
    check_rank_order(rank_order)
    rank, stride = 0, 1
    for axis in rank_order.split("-"):
        size, i = degrees[axis], index.get(axis, 0)
        if not 0 <= i < size:
            raise ValueError(f"{axis} index {i} is outside 0..{size - 1}")
        rank += i * stride
        stride *= size
    return rank


def rank_grid(rank_order: str, *, pp: int, dp: int, tp: int) -> list[list[list[int]]]:
    """`grid[pp_index][dp_index][tp_index]`: the global rank of every coordinate."""
    degrees = {"pp": pp, "dp": dp, "tp": tp}
    return [
        [
            [global_rank(rank_order, degrees, {"pp": p, "dp": d, "tp": t}) for t in range(tp)]
            for d in range(dp)
        ]
        for p in range(pp)
    ]


def expert_index(dp_index: int, ep: int, *, tp_index: int = 0, tp: int = 1) -> tuple[int, int]:
    """(edp_index, ep_index) of a (data, tensor)-parallel coordinate: tp innermost, then
    ep, so an ep group holds neighbouring ranks (dp_index · tp + tp_index = edp_index · ep
    + ep_index)."""
    return divmod(dp_index * tp + tp_index, ep)
