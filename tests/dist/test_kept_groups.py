"""Engines built one after another in one process reuse their layout's meshes
(`plait.mesh.kept`): the process's threads stop growing after the first engine of each
layout (gloo's connection threads of a new group are never freed while the default group
lives; a 46-plan sweep on 4 workers had reached 4,400 threads), and every later engine
still trains to a plain single-process loop's losses. Pipeline channels are made per
engine, on purpose (`plait.runtime.channels.build_channels`), and `Engine.close` releases
them: pipelines built and closed one after another leave no threads behind either.
`plait.mesh.release_kept` destroys the kept meshes too: a process measuring plan after
plan (`plait bench planner`) is back to the threads it started with after each (the
data-parallel reducer's gradient hooks hold it weakly: they live on the parameters, where
the collector cannot follow them, and a strong reference had kept every tensor-parallel
engine's parameters and a group alive), and the next engine of the same layout trains as
before on meshes made afresh (DTensor's caches, which match meshes by value, would
otherwise hand it the destroyed groups)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.config import ParallelPlan
from plait.mesh import build_mesh, release_kept
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_async_pipeline import _microbatch, _model
from .test_hybrid import TOL

pytestmark = pytest.mark.dist

PLANS = (
    ParallelPlan(dp=2, pp=1, microbatches=2),
    ParallelPlan(dp=2, pp=1, microbatches=2, zero=2),
    ParallelPlan(tp=2, pp=1, microbatches=2),
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def _trains_as_one_process(plan: ParallelPlan, *, close: bool = False) -> None:
    model, loss_fn = _model("gpt")
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, _sgd, loss_fn, device="cpu")
    ref_opt = _sgd(ref.parameters())
    for step in range(2):
        x, y = _microbatch("gpt", step, 2 * plan.dp * plan.microbatches)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        loss = engine.step((x, y)).loss
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(loss), ref_loss.detach(), **TOL, msg=where)
    if close:
        engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            engine.step(_microbatch("gpt", 0, 2 * plan.dp * plan.microbatches))


def _sweep(rank: int, world: int) -> None:
    for plan in PLANS:
        _trains_as_one_process(plan)
    after_first = _threads()
    for _ in range(3):
        for plan in PLANS:
            _trains_as_one_process(plan)
    assert _threads() == after_first, (after_first, _threads())
    layout = PLANS[0].layout
    assert build_mesh(layout, "cpu") is build_mesh(layout, "cpu")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_engines_of_one_layout_reuse_its_communicators(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _sweep)


PIPELINES = (
    ParallelPlan(pp=2, microbatches=2, schedule="1f1b"),
    ParallelPlan(pp=2, microbatches=4, schedule="zb-v", chunks=2),
)


def _pipelines(rank: int, world: int) -> None:
    for plan in PIPELINES:
        _trains_as_one_process(plan, close=True)
    after_first = _threads()
    for _ in range(3):
        for plan in PIPELINES:
            _trains_as_one_process(plan, close=True)
    assert _threads() == after_first, (after_first, _threads())


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_closed_pipelines_release_their_channels(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _pipelines)


def _released(rank: int, world: int) -> None:
    started = _threads()
    for _ in range(2):
        for plan in (*PLANS, *PIPELINES):
            _trains_as_one_process(plan, close=True)
            release_kept()
            assert _threads() == started, (plan, started, _threads())


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_released_meshes_free_their_threads_and_later_engines_train(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _released)


def _released_tensor_parallel(rank: int, world: int) -> None:
    # tp groups that are not the default group (at world 2 the tp group is the world, which
    # release leaves alone): each engine after a release shards over new groups, trains as
    # the plain loop does (its losses are checked against it), and leaves no thread behind
    plan = ParallelPlan(dp=2, tp=2, pp=1, microbatches=2)
    started = _threads()
    for _ in range(2):
        _trains_as_one_process(plan, close=True)
        release_kept()
        assert _threads() == started, (started, _threads())


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_tensor_parallel_engine_after_release_trains_on_new_groups(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _released_tensor_parallel)


def _released_since(rank: int, world: int) -> None:
    # `--plan auto` times sharded blocks in meshes it then releases, and only those: a mesh
    # kept before (a caller's engine) still reduces over its groups afterwards
    from plait.layout import Layout
    from plait.mesh import kept_keys

    old = build_mesh(Layout(dp_replicate=2, tp=2), "cpu").main["tp"]
    before, started = kept_keys(), _threads()
    build_mesh(Layout(dp_replicate=1, tp=4), "cpu")
    build_mesh(Layout(dp_replicate=4, tp=1), "cpu")
    assert _threads() > started
    release_kept(kept_keys() - before)
    assert kept_keys() == before
    assert _threads() == started, (started, _threads())
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=old.get_group())
    pair = [r for r in range(world) if r // 2 == rank // 2]  # the tp pairs: (0, 1), (2, 3)
    assert value.item() == float(sum(pair)), (rank, value.item(), pair)
    release_kept()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_of_the_meshes_made_since_leaves_the_older_ones_working(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _released_since)
