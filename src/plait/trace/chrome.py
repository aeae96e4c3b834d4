"""Chrome / Perfetto trace files of timelines (the Trace Event Format's complete events).

Each span becomes one event `{"ph": "X", "name": label, "pid": rank, "tid": lane, "ts":
µs, "dur": µs, "cat": kind}`; compute runs on lane 0 of its rank, communication on lane 1
(sends overlap compute), so that nothing on one lane overlaps. Metadata events name each
rank's process (`rank 3`) and lanes. Open the file in https://ui.perfetto.dev or
chrome://tracing. Several timelines (predicted and measured) go in one file as separate
processes, `pid_offset` apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.trace.spans import Span

__all__ = ["chrome_trace", "write_chrome_trace"]

_LANES = {"comm": 1}
_LANE_NAMES = ("compute", "communication")


def _metadata(pid: int, name: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": pid},
        },
    ]
    for tid, lane in enumerate(_LANE_NAMES):
        out.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}}
        )
    return out


def chrome_trace(
    timelines: Mapping[str, Sequence[Span]] | Sequence[Span],
    *,
    pid_offset: int = 1000,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The trace object of one timeline (spans), or of several named ones (`{"predicted":
    spans, "measured": spans}`, the i-th one's ranks at pid i × `pid_offset` + rank)."""
    named = timelines if isinstance(timelines, Mapping) else {"": timelines}
    events: list[dict[str, Any]] = []
    for index, (title, spans) in enumerate(named.items()):
        base = index * pid_offset
        for rank in sorted({s.rank for s in spans}):
            events += _metadata(base + rank, f"{title} rank {rank}".strip())
        for s in spans:
            event = {
                "name": s.label,
                "cat": s.kind,
                "ph": "X",
                "pid": base + s.rank,
                "tid": _LANES.get(s.kind, 0),
                "ts": s.start * 1e6,
                "dur": max(s.end - s.start, 0.0) * 1e6,
            }
            if s.step is not None:
                event["args"] = {"step": s.step}
            events.append(event)
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = metadata
    return trace


def write_chrome_trace(
    path: str | Path,
    timelines: Mapping[str, Sequence[Span]] | Sequence[Span],
    *,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write `chrome_trace(timelines)` as JSON to `path` (folders created); returns it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(timelines, metadata=metadata)))
    return out
