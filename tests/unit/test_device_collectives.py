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
from plait.train.planinputs import measure_collectives
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
    assert len(seen) == 10 and {d for _, d in seen} == {META}


def test_the_measured_link_reproduces_a_ring_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """An emulated ring of 4 ranks: each all-reduce of b bytes takes 6 hops of 50 µs and
    2·3/4·b bytes at 1 GB/s; every fourth call is a slow spell of 2 ms more. The sizes take
    turns, so the spells land on every size alike and the medians give the ring back."""
    clock, calls = [0.0], []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        calls.append(tensor.numel() * 4)
        hops = 6 * 50e-6 + 1.5 * tensor.numel() * 4 / 1e9
        clock[0] += hops + (2e-3 if len(calls) % 4 == 0 else 0.0)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    monkeypatch.setattr("plait.train.planinputs.timer", lambda device: lambda: clock[0])
    link = measure_collectives(torch.device("cpu"), repeats=7)
    assert link.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(1e9, rel=1e-6)
    sizes = sorted(set(calls))
    assert calls[: len(sizes)] == sizes  # one of each size before any size again


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
