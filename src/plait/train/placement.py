"""`rank_pipeline`: the pipeline this rank runs under a plan, as one kind of object whatever
shape the plan's data-parallel replicas take.

A homogeneous plan is one grid of ranks (`plait.mesh.build_mesh`): every replica runs the
same pipeline, and this rank's is the pp column of its (dp, tp, ...) place. A plan whose
replicas are pipelines of their own (HetPipe's virtual workers, Park et al., ATC 2020:
`plan.pipelines`; Wave Synchronous Parallel: `plan.wsp_staleness`) has no such grid: each
pipeline has its own ranks, depth, stage cut and micro-batch count
(`plait.pipelines.PipelineLayout`), so this rank runs its pipeline as a plan of its own
(dp = 1) on a mesh assembled from that pipeline's process group, and the block groups
(`plait.parallel.hetero.PipelineGroups`) say where the pipelines meet. What follows (the
passes, the engine) reads the same fields in both cases.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from plait.config import ParallelPlan
from plait.mesh import Meshes, build_mesh, pipeline_mesh
from plait.parallel.hetero import PipelineGroups, pipeline_groups
from plait.pipelines import PipelineLayout, pipeline_layout
from plait.runtime.channels import Channels, build_channels
from plait.schedule import Schedule, build

__all__ = ["RankPipeline", "has_pipelines", "layout_of", "rank_pipeline"]


@dataclass(frozen=True)
class RankPipeline:
    """This rank's pipeline: its plan (with its micro-batch count), meshes, schedule,
    message channels and stage cut."""

    # the pipeline's own plan: the plan itself when every replica runs the same pipeline
    plan: ParallelPlan
    meshes: Meshes
    schedule: Schedule
    channels: Channels | None
    pp_rank: int  # this rank's place in its pipeline
    sizes: tuple[int, ...] | None  # blocks per stage (None: an equal split)
    # pipelines of their own: every pipeline's ranks and the groups of ranks sharing blocks
    groups: PipelineGroups | None = None


def has_pipelines(plan: ParallelPlan) -> bool:
    """Whether `plan`'s data-parallel replicas are pipelines of their own."""
    return plan.pipelines is not None or plan.wsp_staleness is not None


def rank_pipeline(
    plan: ParallelPlan,
    *,
    num_blocks: int,
    device_type: str,
    mesh: DeviceMesh | None = None,
    experts: bool = False,
) -> RankPipeline:
    """This rank's pipeline under `plan` over a model of `num_blocks` blocks; `mesh`: the
    caller's (homogeneous plans only), `experts`: the model has experts (an expert view of
    the ranks is built). Collective: every rank calls it, in the same order."""
    if has_pipelines(plan):
        return _own_pipeline(plan, num_blocks, device_type)
    meshes = (
        Meshes(main=mesh)
        if mesh is not None
        else build_mesh(plan.layout, device_type, experts=experts)
    )
    schedule = build(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
    return RankPipeline(
        plan=plan,
        meshes=meshes,
        schedule=schedule,
        channels=_grid_channels(schedule, meshes.main),
        pp_rank=meshes.main.get_local_rank("pp"),
        sizes=plan.partition,
    )


def _own_pipeline(plan: ParallelPlan, num_blocks: int, device_type: str) -> RankPipeline:
    layout = layout_of(plan, num_blocks)
    groups = pipeline_groups(layout)
    i = groups.pipeline
    pp = len(layout.ranks[i])
    mine = dataclasses.replace(
        plan, dp=1, dp_replicate=None, dp_shard=None, pp=pp, partition=layout.sizes[i],
        microbatches=layout.microbatches[i],
        pipelines=None, wsp_staleness=None, wsp_at_most=False,
    )  # fmt: skip
    # every rank makes every pipeline's channels, in one order (they are process groups)
    channels = build_channels([
        (build(plan.schedule, len(ranks), count, plan.chunks), ranks)
        for ranks, count in zip(layout.ranks, layout.microbatches, strict=True)
    ])  # fmt: skip
    mesh = pipeline_mesh(mine.layout, layout.ranks[i], groups.pp_group, device_type)
    return RankPipeline(
        plan=mine,
        meshes=Meshes(main=mesh),
        schedule=build(plan.schedule, pp, mine.microbatches, plan.chunks),
        channels=channels,
        pp_rank=groups.pp_rank,
        sizes=layout.sizes[i],
        groups=groups,
    )


def layout_of(plan: ParallelPlan, num_blocks: int | None = None) -> PipelineLayout:
    """The pipelines of `plan`: its `pipelines`, or dp alike ones (`partition`, or an equal
    split of `num_blocks`)."""
    if plan.pipelines is not None:
        sizes = [p.partition for p in plan.pipelines]
        counts = [p.microbatches for p in plan.pipelines]
        return pipeline_layout(sizes, counts, chunks=plan.chunks, rank_order=plan.rank_order)
    if plan.partition is not None:
        part: tuple[int, ...] = plan.partition
    else:
        if num_blocks is None:
            raise ValueError("an equal split needs the number of blocks")
        stages = plan.num_stages
        part = tuple(num_blocks // stages + (s < num_blocks % stages) for s in range(stages))
    return pipeline_layout(
        [part] * plan.dp, [plan.microbatches] * plan.dp, chunks=plan.chunks,
        rank_order=plan.rank_order,
    )  # fmt: skip


def _grid_channels(schedule: Schedule, mesh: DeviceMesh) -> Channels | None:
    """Every pipeline's message channels (`plait.runtime.channels`), made on every rank
    in one order; this rank's. Each pipeline is the pp column of one (dp, tp) place."""
    if schedule.num_ranks == 1:
        return None
    names = mesh.mesh_dim_names or ()
    grid = mesh.mesh.movedim(names.index("pp"), 0).reshape(mesh["pp"].size(), -1)
    pipelines = [(schedule, [int(r) for r in grid[:, j]]) for j in range(grid.shape[1])]
    return build_channels(pipelines)
