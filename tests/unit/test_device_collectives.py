"""The tensors a worker hands to collectives live on its device, not the CPU's by default.

torch.distributed's calls are replaced by recorders; the worker's device is `meta`, which
stands for any device other than the CPU (a tensor made without naming it would be a CPU
one, and NCCL refuses CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.profile.calibrate import pingpong
from plait.schedule import build
from plait.train.autoplan import measure_collectives
from plait.train.repartition import stage_seconds

META = torch.device("meta")


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.device]]:
    """(call, device of its tensor) of every tensor collective; a world of 2 ranks."""
    calls: list[tuple[str, torch.device]] = []

    def recorder(name: str) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            calls.append((name, tensor.device))

        return call

    for name in ("all_reduce", "send", "recv", "broadcast"):
        monkeypatch.setattr(dist, name, recorder(name))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    return calls


def test_the_auto_planner_measures_collectives_on_the_workers_device(
    seen: list[tuple[str, torch.device]],
) -> None:
    link = measure_collectives(META, repeats=2)
    assert link.bandwidth_Bps > 0
    assert len(seen) == 6 and {d for _, d in seen} == {META}


def test_calibration_ping_pongs_on_the_workers_device(
    seen: list[tuple[str, torch.device]],
) -> None:
    pingpong(0, sizes=(1024, 4096), repeats=1, device=META)
    assert {name for name, _ in seen} == {"send", "recv"}
    assert {d for _, d in seen} == {META}


def test_repartitioning_reduces_stage_times_on_the_workers_device(
    seen: list[tuple[str, torch.device]],
) -> None:
    schedule = build("1f1b", 2, 2, 1)
    records = [SimpleNamespace(index=i, start=0.0, end=1.0) for i in range(len(schedule.ranks[0]))]
    engine = SimpleNamespace(
        schedule=schedule,
        executor=SimpleNamespace(rank=0),
        device=META,
        mesh=SimpleNamespace(get_group=lambda axis: None),
    )
    report = SimpleNamespace(result=SimpleNamespace(records=records))
    with pytest.raises(NotImplementedError):  # meta tensors hold no values to read back
        stage_seconds(engine, report)  # type: ignore[arg-type]
    assert seen == [("all_reduce", META)]
