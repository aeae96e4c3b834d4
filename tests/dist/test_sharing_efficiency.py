"""`plait.profile.sharing.measure_sharing_efficiency`: the share of a core's speed each of
the workers pinned to it keeps, n × (seconds alone) / (seconds shared), on rank 0's clock
and agreed by every rank.

The arithmetic and the protocol are checked on a scripted clock (the expected value is
the model's definition worked by hand); the measurement itself on two real workers pinned
to one core, where a CPU-bound pass shared must run at most at the core's full speed
split between them, and not below half of that (time-sharing loses switches and cache
refills, not the core)."""

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
    # rank 0: a warm-up, then per repeat one alone timing of 1.0 s and one shared of 2.5 s;
    # rank 1 (no core of its own with cores=1) times only shared passes, of 9 s
    model, sample = _model()
    calls = {"n": 0}
    alone, shared = 1.0, 2.5 if rank == 0 else 9.0

    def clock() -> float:
        calls["n"] += 1
        return 0.0 if calls["n"] % 2 else (alone if rank == 0 and calls["n"] % 4 == 0 else shared)

    original = sharing.perf_counter
    sharing.perf_counter = clock
    try:
        found = sharing.measure_sharing_efficiency(
            model, sample, nn.functional.cross_entropy, cores=1, passes=1, repeats=3
        )
    finally:
        sharing.perf_counter = original
    # rank 0's clock: calls 1-2 warm-up, then (alone: 3-4, shared: 5-6) per repeat
    assert found == pytest.approx(2 * 1.0 / 2.5), (rank, found)
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
    found = sharing.measure_sharing_efficiency(
        model, sample, nn.functional.cross_entropy, cores=1, passes=3, repeats=5
    )
    everyone = [0.0] * world
    dist.all_gather_object(everyone, found)
    assert everyone == [found] * world, everyone
    assert 0.5 < found <= 1.0, found


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins workers to one core")
def test_two_workers_on_one_core_keep_between_half_and_all_of_it(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _pinned)
