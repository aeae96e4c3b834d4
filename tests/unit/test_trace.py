"""Timelines: spans from simulated and measured steps, Chrome trace JSON, PNG Gantt charts."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from plait.cluster import Cluster as ClusterType
from plait.cluster import Device, Link, NodeGroup
from plait.cost import BlockCost
from plait.sim import SimPlan, build_schedule, simulate
from plait.trace import (
    Span,
    chrome_trace,
    kind_of,
    plot_comparison,
    plot_timeline,
    spans_from_records,
    spans_from_timeline,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Record:
    """The shape of the runtime's ActionRecord."""

    rank: int
    index: int
    label: str
    start: float
    end: float
    wait: float = 0.0


def predicted(kind: str = "1f1b", p: int = 2, m: int = 3) -> list[Span]:
    device = Device(name="unit", peak_flops={"fp32": 1.0}, memory_bytes=1 << 40)
    link = Link(latency_s=0.1, bandwidth_Bps=1.0)
    group = NodeGroup(device=device, devices_per_node=p, intra_node=link)
    cluster = ClusterType(name="unit", groups=(group,), inter_node=link)
    block = BlockCost(name="b", forward_flops=1, backward_input_flops=1, backward_weight_flops=1,
                      activation_bytes=0.1)  # fmt: skip
    plan = SimPlan(pp=p, microbatches=m, schedule=kind, dtype="fp32")
    result = simulate(build_schedule(plan), [block] * p, cluster, plan)
    return spans_from_timeline(result.timeline)


def measured() -> list[list[Record]]:
    return [
        [Record(0, 0, "0F0", 0.0, 1.0), Record(0, 1, "0SEND_F0", 1.0, 1.01),
         Record(0, 2, "0RECV_B0", 1.01, 1.01), Record(0, 3, "0B0", 3.0, 5.0, wait=1.5)],
        [Record(1, 0, "1RECV_F0", 0.0, 0.0), Record(1, 1, "1F0", 1.2, 2.2, wait=1.2),
         Record(1, 2, "1B0", 2.2, 4.2), Record(1, 3, "1SEND_B0", 4.2, 4.25)],
    ]  # fmt: skip


def test_kinds_of_labels() -> None:
    assert [kind_of(x) for x in ("2F0", "0B11", "1BI3", "1BW3", "3F2v1")] == [
        "F", "B", "BI", "BW", "F",
    ]  # fmt: skip
    assert [kind_of(x) for x in ("1SEND_F0", "0RECV_B2", "0DP", "OPT")] == [
        "comm", "comm", "comm", "optimizer",
    ]  # fmt: skip


def test_spans_from_a_simulated_step() -> None:
    spans = predicted()
    assert {s.rank for s in spans} == {0, 1}
    computes = [s for s in spans if s.kind in ("F", "B")]
    assert len(computes) == 2 * 2 * 3  # ranks × (F, B) × micro-batches
    assert any(s.kind == "optimizer" for s in spans)
    assert all(s.end >= s.start for s in spans)


def test_spans_from_measured_records_share_a_clock_and_show_waits() -> None:
    spans = spans_from_records(measured(), offsets=[0.0, 0.5])
    labels = [s.label for s in spans]
    assert "0RECV_B0" not in labels and "1RECV_F0" not in labels  # posting is instantaneous
    wait = next(s for s in spans if s.label == "wait 1F0")
    assert (wait.kind, wait.start, wait.end) == ("wait", 0.5, 1.7)
    forward = next(s for s in spans if s.label == "1F0")
    assert (forward.start, forward.end) == (1.7, 2.7)
    assert len(spans_from_records(measured(), waits=False, receives=True)) == 8


def test_chrome_trace_structure(tmp_path: Path) -> None:
    spans = predicted()
    trace = chrome_trace(spans)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans)
    for e, s in zip(complete, spans, strict=True):
        assert e["name"] == s.label and e["pid"] == s.rank and e["cat"] == s.kind
        assert e["ts"] == pytest.approx(s.start * 1e6) and e["dur"] == pytest.approx(
            (s.end - s.start) * 1e6
        )
        assert e["tid"] == (1 if s.kind == "comm" else 0)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    path = write_chrome_trace(tmp_path / "sub" / "t.json", spans, metadata={"plan": "1f1b"})
    assert json.loads(path.read_text()) == chrome_trace(spans, metadata={"plan": "1f1b"})


def test_predicted_and_measured_in_one_trace() -> None:
    both = {"predicted": predicted(), "measured": spans_from_records(measured())}
    events = chrome_trace(both)["traceEvents"]
    pids = {e["pid"] for e in events if e["ph"] == "X"}
    assert pids == {0, 1, 1000, 1001}
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert "predicted rank 0" in names and "measured rank 1" in names


def test_png_gantt_and_comparison(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    one = plot_timeline(predicted("zb-h1", 3, 4), tmp_path / "one.png", title="zb-h1")
    two = plot_comparison(
        predicted(), spans_from_records(measured()), tmp_path / "a" / "two.png", title="1f1b"
    )
    for path in (one, two):
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert path.stat().st_size > 5000


def test_png_without_matplotlib_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(RuntimeError, match=r"pip install 'plait\[plot\]'"):
        plot_timeline(predicted(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
