"""`parallelize` is one builder: a plan whose replicas are pipelines of their own (HetPipe,
WSP) runs the same ordered passes as any plan, on this rank's pipeline, with the passes
that join the pipelines active exactly for such plans."""

from __future__ import annotations

import dataclasses

import pytest

import plait.train.hetero
import plait.train.parallelize
from plait.config import ParallelPlan, PipelineSpec
from plait.train.passes import PASSES, Request

JOINING = ("pipelines start alike", "share reducer", "waves")


def _active(request: Request) -> list[str]:
    return [p.name for p in PASSES if p.active(request)]


def _own(plan: ParallelPlan) -> Request:
    """The request `parallelize` gives the passes for one rank of `plan` (the rank's
    pipeline as a plan of its own, written out here)."""
    mine = dataclasses.replace(plan, dp=1, pipelines=None, wsp_staleness=None)
    return Request(mine, whole=plan)


def test_the_joining_passes_act_only_for_pipelines_of_their_own() -> None:
    hetero = ParallelPlan(dp=2, pp=2, pipelines=(PipelineSpec(partition=(4,), microbatches=2),
                          PipelineSpec(partition=(2, 2), microbatches=2)))  # fmt: skip
    wsp = ParallelPlan(dp=2, pp=1, wsp_staleness=1)
    active = _active(_own(hetero))
    assert [n for n in active if n in JOINING] == ["pipelines start alike", "share reducer"]
    assert [n for n in _active(_own(wsp)) if n in JOINING] == ["pipelines start alike", "waves"]
    for plan in (ParallelPlan(dp=2, pp=2), ParallelPlan(dp=2, pp=1, zero=1), ParallelPlan()):
        assert not set(_active(Request(plan))) & set(JOINING), plan
    # the rank's own pipeline reduces nothing by itself: no reducer beside the share reducer
    assert "reducer" not in active and "fsdp" not in active


def test_the_joining_passes_come_in_the_order_the_pipelines_need() -> None:
    names = [p.name for p in PASSES]
    # weights alike before any gradient sync is built; waves after the optimizers exist
    assert names.index("compile") < names.index("pipelines start alike") < names.index("fsdp")
    assert names.index("reducer") < names.index("share reducer") < names.index("optimizer")
    assert names.index("optimizer") < names.index("waves")


def test_there_is_one_builder() -> None:
    assert not hasattr(plait.train.hetero, "parallelize_hetero")
    assert not hasattr(plait.train.parallelize, "parallelize_hetero")


def test_offloading_pipelines_of_their_own_is_refused_at_the_plan() -> None:
    with pytest.raises(ValueError, match="offloading with wsp_staleness is not supported"):
        ParallelPlan(dp=2, pp=1, wsp_staleness=1, offload_optimizer=True)
    with pytest.raises(ValueError, match=r"offloading with pipelines \(a heterogeneous plan\)"):
        ParallelPlan(dp=2, pp=1, offload_activations="all",
                     pipelines=(PipelineSpec(partition=(4,), microbatches=2),
                                PipelineSpec(partition=(4,), microbatches=1)))  # fmt: skip


def test_a_replicated_schedule_with_pipelines_of_their_own_is_refused_at_the_plan() -> None:
    with pytest.raises(ValueError, match=r"schedule='chimera' \(replicated stages\) with wsp"):
        ParallelPlan(dp=2, pp=2, schedule="chimera", wsp_staleness=0)
