"""Recomputation per stage for a plan that recomputes every stage: each stage recomputes
only as much as its rank's memory needs (1F1B's first stage holds p micro-batches of
activations, its last one), on the same cut, so the stages that have room run their
backward without repeating the forward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from plait.cluster import Cluster
from plait.cost import Recompute, StageCost
from plait.plan.space import ModelSpec
from plait.sim import SimPlan, SimResult, build_schedule, simulate

__all__ = ["LEVELS", "lighter_recompute"]

LEVELS: tuple[Recompute, ...] = ("none", "selective", "full")


def lighter_recompute(
    plan: SimPlan, sizes: tuple[int, ...], model: ModelSpec, cluster: Cluster, margin: float
) -> tuple[SimPlan, SimResult] | None:
    """`plan` (uniform recomputation, cut as `sizes`) with each stage's mode lowered to the
    least under which every rank keeps `margin` of its memory free, and its simulation; None
    when the modes come out all the same (or `plan` cannot take per-stage modes).

    From no recomputation up: every rank over its memory raises its stages one level, until
    all fit; a stage never exceeds the plan's own mode, which fits."""
    top = LEVELS.index(plan.recompute)
    if top == 0 or plan.pp == 1 or plan.total_microbatches or plan.pipelines is not None:
        return None
    schedule = build_schedule(plan, check=False, lowered=False)
    parts = schedule.parts
    modes = [0] * schedule.num_parts
    cut = _stages(model, sizes)
    while True:
        trial = dataclasses.replace(
            plan, recompute="none", recompute_stages=tuple(LEVELS[m] for m in modes)
        )
        result = simulate(schedule, cut(trial), cluster, trial)
        over = [r.pp_rank for r in result.ranks if r.memory.total > (1 - margin) * r.capacity_bytes]
        if not over:
            # all at the plan's mode, or none at all (a plan the search has tried): no news
            return (trial, result) if max(modes) > 0 and min(modes) < top else None
        raised = False
        for rank in over:
            for stage in schedule.stages_of(rank):
                if modes[parts[stage]] < top:
                    modes[parts[stage]] += 1
                    raised = True
        if not raised:
            return None


def _stages(model: ModelSpec, sizes: tuple[int, ...]) -> Callable[[SimPlan], list[StageCost]]:
    def cut(plan: SimPlan) -> list[StageCost]:
        blocks, out, first = model.blocks_for(plan), [], 0
        for n in sizes:
            out.append(StageCost(tuple(blocks[first : first + n])))
            first += n
        return out

    return cut
