"""Where the pipelines (virtual workers) of a heterogeneous plan sit: their ranks, their
stages' blocks, and which ranks hold each block.

Pure arithmetic (no torch), shared by the configuration (validation), the runtime
(`plait.parallel.hetero` builds its process groups from it) and the simulator.

Pipelines of one depth sit where the plan's rank order puts data-parallel replicas
(`plait.layout`; under "tp-dp-pp" pipeline i holds ranks i, i + dp, ...), the ranks the
planner simulated them on. Pipelines of different depths have no such grid: they take
consecutive ranks, pipeline 0 first (pipelines of 1 and 3 ranks: rank 0, then ranks 1..3).

Each pipeline may cut the model differently, so block b sits on pipeline rank 0 in one
pipeline and on pipeline rank 2 in another: gradients (or WSP's updates) are reduced per
block, over the ranks that hold it, one in each pipeline. Blocks held by the same ranks
form one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from plait.layout import Layout
from plait.schedule.registry import schedule_kind

__all__ = [
    "PipelineLayout",
    "check_hetero_plan",
    "check_pipelines",
    "hetero_refusal",
    "pipeline_layout",
]


@dataclass(frozen=True)
class PipelineLayout:
    """The ranks of each pipeline and the groups of ranks that share blocks."""

    ranks: tuple[tuple[int, ...], ...]  # global ranks of each pipeline, stage-rank order
    sizes: tuple[tuple[int, ...], ...]  # blocks per stage of each pipeline
    microbatches: tuple[int, ...]  # micro-batches per step of each pipeline
    chunks: int  # virtual stages per rank (stage s of pipeline i sits on rank s % pp_i)

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks)

    @property
    def num_blocks(self) -> int:
        return sum(self.sizes[0])

    def pipeline_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.ranks) if rank in ranks)

    def holder(self, pipeline: int, block: int) -> int:
        """The global rank of `pipeline` that holds `block`."""
        first = 0
        for stage, n in enumerate(self.sizes[pipeline]):
            if first <= block < first + n:
                pp = len(self.ranks[pipeline])
                return self.ranks[pipeline][stage % pp]
            first += n
        raise ValueError(f"block {block} is outside 0..{self.num_blocks - 1}")

    def block_groups(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Ranks (one per pipeline, in pipeline order) -> the blocks they all hold; in order
        of each group's first block, the same on every rank."""
        out: dict[tuple[int, ...], list[int]] = {}
        for block in range(self.num_blocks):
            key = tuple(self.holder(i, block) for i in range(len(self.ranks)))
            out.setdefault(key, []).append(block)
        return {k: tuple(v) for k, v in out.items()}

    def batch_shares(self) -> tuple[float, ...]:
        """Each pipeline's share of the global batch (its micro-batches over all)."""
        total = sum(self.microbatches)
        return tuple(m / total for m in self.microbatches)


def check_pipelines(
    sizes: Sequence[Sequence[int]], microbatches: Sequence[int], *, chunks: int, dp: int
) -> None:
    """Raise ValueError unless the pipelines cut one model (the same number of blocks)
    into whole ranks (stages a multiple of `chunks`), one pipeline per data-parallel
    replica."""
    if len(sizes) != dp:
        raise ValueError(
            f"pipelines={len(sizes)} pipelines but dp={dp}: a heterogeneous plan has one "
            "pipeline per data-parallel replica; set dp to the number of pipelines"
        )
    totals = {sum(s) for s in sizes}
    if len(totals) != 1:
        raise ValueError(
            f"pipelines: partitions {[list(s) for s in sizes]} cut different numbers of blocks "
            f"{sorted(totals)}: every pipeline must hold the whole model"
        )
    for part, m in zip(sizes, microbatches, strict=True):
        if len(part) % chunks:
            raise ValueError(
                f"pipelines: partition={list(part)} has {len(part)} stages, not a multiple of "
                f"chunks={chunks}: give pp × chunks stages"
            )
        if m < 1:
            raise ValueError(f"pipelines: microbatches={m} must be a positive integer")


def pipeline_layout(
    sizes: Sequence[Sequence[int]],
    microbatches: Sequence[int],
    *,
    chunks: int = 1,
    rank_order: str = "tp-dp-pp",
) -> PipelineLayout:
    """The layout of pipelines cut by `sizes` (blocks per stage each); see the module
    docstring for their ranks."""
    check_pipelines(sizes, microbatches, chunks=chunks, dp=len(sizes))
    depths = [len(part) // chunks for part in sizes]
    ranks: list[tuple[int, ...]] = []
    if len(set(depths)) == 1:
        grid = Layout(pp=depths[0], dp_replicate=len(sizes), rank_order=rank_order)
        for d in range(len(sizes)):
            at = [grid.global_rank({"pp": s, "dp": d}) for s in range(depths[0])]
            ranks.append(tuple(at))
    else:
        first = 0
        for pp in depths:
            ranks.append(tuple(range(first, first + pp)))
            first += pp
    return PipelineLayout(
        ranks=tuple(ranks),
        sizes=tuple(tuple(s) for s in sizes),
        microbatches=tuple(microbatches),
        chunks=chunks,
    )


def hetero_refusal(plan: Any) -> str | None:
    """Why the runtime of pipelines of their own cannot take `plan`'s options (None: it
    can); `check_hetero_plan` raises it. The planner asks before it proposes such a plan
    (`plait.plan.exact.exact_of`), so that every plan it writes trains."""
    what = "pipelines (a heterogeneous plan)" if plan.pipelines is not None else "wsp_staleness"
    for name, value, default in (("tp", plan.tp, 1), ("ep", plan.ep, 1), ("zero", plan.zero, 0),
                                 ("compress", plan.compress, "none")):  # fmt: skip
        if value != default:
            return (
                f"{name}={value!r} with {what}: the runtime of virtual workers takes whole, "
                f"unsharded pipelines; set {name}={default!r}"
            )
    if not schedule_kind(plan.schedule).synchronous:
        return (
            f"schedule={plan.schedule!r} (asynchronous) with {what}: each virtual worker runs "
            "a synchronous schedule (gpipe, 1f1b, interleaved, zb-h1...)"
        )
    if schedule_kind(plan.schedule).replicated:
        # each block group keeps one copy of a block in step; Chimera's second copy would
        # drift from it unsummed
        return (
            f"schedule={plan.schedule!r} (replicated stages) with {what}: the pipelines "
            "join one copy of each block; use a schedule of one copy (1f1b, gpipe, zb-h1...)"
        )
    if plan.offload_activations != "none" or plan.offload_optimizer:
        # not yet tested against one process with the pipelines' own reductions
        return (
            f"offloading with {what} is not supported yet: drop offload_activations and "
            "offload_optimizer, or use one pipeline layout"
        )
    return None


def check_hetero_plan(plan: Any) -> None:
    """Raise ValueError for what the runtime of heterogeneous pipelines and WSP (the
    passes of `plait.train.parallelize` that join pipelines) cannot apply in `plan`, a
    `plait.config.ParallelPlan` (typed Any: config imports this module). That runtime runs
    whole pipelines, each on its own synchronous schedule, and reduces plain (unsharded)
    tensors."""
    why = hetero_refusal(plan)
    if why is not None:
        raise ValueError(why)
    if plan.pipelines is not None:
        sizes = [p.partition for p in plan.pipelines]
        check_pipelines(sizes, [p.microbatches for p in plan.pipelines], chunks=plan.chunks,
                        dp=plan.dp)  # fmt: skip
    elif plan.dp < 2:
        raise ValueError(
            f"wsp_staleness={plan.wsp_staleness} with dp={plan.dp}: staleness bounds how far "
            "data-parallel replicas run apart; use dp >= 2 or unset wsp_staleness"
        )
