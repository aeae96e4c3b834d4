"""The executor's per-action times come from the device's clock: on the CPU the wall clock
(`perf_counter`) around each action, read once per window."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch
from torch import nn

from plait.blocks import StageModule
from plait.device import ActionClock
from plait.runtime import PipelineExecutor
from plait.schedule import build


class _Timed(nn.Linear):
    """A block that notes the clock when its forward begins and ends."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.spans: list[tuple[float, float]] = []

    def forward(self, x: Any) -> Any:
        begin = time.perf_counter()
        out = super().forward(x)
        self.spans.append((begin, time.perf_counter()))
        return out


def test_cpu_records_hold_the_perf_counter_spans_of_their_actions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
    torch.manual_seed(0)
    block = _Timed(4, 3)
    stage = StageModule([block], first_block=0)
    executor = PipelineExecutor(build("gpipe", 1, 2), {0: stage}, rank=0,
                                loss_fn=lambda out, y: (out - y).square().mean())  # fmt: skip
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    result = executor.step([x[:2], x[2:]], [y[:2], y[2:]])
    records = result.records
    labels = [r.label for r in records]
    assert labels == [str(a) for a in executor.schedule.ranks[0]]
    forwards = [r for r in records if "F" in r.label]
    assert len(forwards) == len(block.spans) == 2
    for record, (begin, end) in zip(forwards, block.spans, strict=True):
        assert record.start < begin < end < record.end  # the action holds its forward
    for before, after in itertools.pairwise(records):
        assert before.end <= after.start  # one action after another, none hidden
    assert result.step_time == records[-1].end
    assert all(r.wait == 0.0 for r in records)


def test_the_cpu_clock_is_the_wall_clock() -> None:
    clock = ActionClock(torch.device("cpu"))
    start = clock.start()
    marks = [clock.mark() for _ in range(3)]
    seconds = clock.seconds(marks)
    assert seconds == [m - start for m in marks] and seconds == sorted(seconds)
