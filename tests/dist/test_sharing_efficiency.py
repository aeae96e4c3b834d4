"""`plait.profile.sharing.measure_sharing_efficiency`: the share of a core's time-shared
seconds that still compute, (CPU seconds of a pass alone) / (CPU seconds of the pass
while every worker trains at once, its gradients all-reduced), on rank 0's clock and
agreed by every rank.

The arithmetic and the protocol are checked on a scripted clock (the expected value is
the definition worked by hand); the measurement itself on two real workers pinned to one
core: a share in (0, 1] that both ranks agree on, the caller's model left as it was (the
passes run on a copy)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import plait.profile.sharing as sharing

from .harness import run_world

pytestmark = pytest.mark.dist


def _model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    return model, (torch.randn(256, 256), torch.randint(0, 8, (256,)))


def _scripted(rank: int, world: int) -> None:
    # every rank: two warm-ups, each alone then shared; then per repeat, rank 0 (the one
    # with a core of its own at cores=1) times a pass alone of 1.0 CPU s and one shared of
    # 2.5 s; rank 1 only shared ones, of 9 s
    model, sample = _model()
    calls = {"n": 0}

    def clock() -> float:
        calls["n"] += 1
        if calls["n"] % 2:
            return 0.0  # a timing's start
        timing = calls["n"] // 2  # 1-4: warm-ups; alternately alone and shared on rank 0
        if rank == 0:
            return 1.0 if timing % 2 else 2.5
        return 9.0

    original = sharing.process_time
    sharing.process_time = clock
    try:
        found = sharing.measure_sharing_efficiency(
            model, sample, nn.functional.cross_entropy, cores=1, passes=1, repeats=3
        )
    finally:
        sharing.process_time = original
    assert found == pytest.approx(1.0 / 2.5), (rank, found)
    # with a core each, no sharing
    assert (
        sharing.measure_sharing_efficiency(model, sample, nn.functional.cross_entropy, cores=2)
        == 1.0
    )
    with pytest.raises(ValueError, match="cores=0"):
        sharing.measure_sharing_efficiency(model, sample, nn.functional.cross_entropy, cores=0)


def test_scripted_clock_gives_the_definition(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _scripted)


def _pinned(rank: int, world: int) -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # both workers on one core
    model, sample = _model()
    before = [p.detach().clone() for p in model.parameters()]
    found = sharing.measure_sharing_efficiency(
        model, sample, nn.functional.cross_entropy, cores=1, passes=3, repeats=5
    )
    everyone = [0.0] * world
    dist.all_gather_object(everyone, found)
    assert everyone == [found] * world, everyone
    # a share of the core: above 0, at most all of it (a pass shared on one core can cost
    # over twice its CPU alone, in switches and the all-reduce's copies: 0.42 under a
    # loaded host, so no lower bound but 0)
    assert 0.0 < found <= 1.0, found
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins workers to one core")
def test_two_workers_on_one_core_keep_at_most_all_of_it(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _pinned)


def _posting(rank: int, world: int) -> None:
    from plait.profile.calibrate import posting_s

    found = posting_s(64 * 1024)
    everyone = [0.0] * world
    dist.all_gather_object(everyone, found)
    assert everyone == [found] * world, everyone
    assert 0.0 < found < 0.05, found  # posting a message takes time, not a step's worth


def test_posting_a_message_is_measured_alike_on_every_rank(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _posting)
