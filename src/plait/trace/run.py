"""The run folder's pictures of its last measured steps: `trace.json` and `timeline.png`.

Each rank times its records from the start of its own step, so steps are laid end to end:
step k starts when the slowest rank finished step k-1 (the gap between steps, spent in
the training loop outside the executor, is left out). Ranks are not aligned to one clock;
a rank that started its step late shows its waits as idle time at the start instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from plait.trace.chrome import write_chrome_trace
from plait.trace.gantt import plot_timeline
from plait.trace.spans import Span, spans_from_records

__all__ = ["run_spans", "write_run_timeline"]


def run_spans(
    recent: Sequence[Sequence[dict[str, Any]]], *, waits: bool = False, receives: bool = True
) -> list[Span]:
    """Spans of the steps in `recent` (per rank, the steps it kept: `{"step", "step_time",
    "records"}`), each step after the previous one. By default one span per record."""
    out: list[Span] = []
    offset = 0.0
    num_steps = min((len(steps) for steps in recent), default=0)
    for k in range(num_steps):
        per_rank = [steps[len(steps) - num_steps + k] for steps in recent]
        records = [[SimpleNamespace(**r) for r in entry["records"]] for entry in per_rank]
        out += spans_from_records(
            records,
            offsets=[offset] * len(records),
            waits=waits,
            receives=receives,
            step=per_rank[0]["step"],
        )
        offset += max(entry["step_time"] for entry in per_rank)
    return out


def write_run_timeline(
    run_dir: str | Path,
    recent: Sequence[Sequence[dict[str, Any]]],
    *,
    step_time_s: float,
    bubble: float,
) -> list[Path]:
    """Write trace.json (one process per rank, one slice per action) and, when matplotlib
    is installed, timeline.png titled with the step time and bubble; returns the paths."""
    run_dir = Path(run_dir)
    steps = sorted({s.step for s in run_spans(recent) if s.step is not None})
    title = (
        f"measured steps {steps[0]}–{steps[-1]}: {step_time_s * 1e3:.1f} ms/step, "
        f"bubble {bubble:.1%}"
        if steps
        else f"{step_time_s * 1e3:.1f} ms/step, bubble {bubble:.1%}"
    )
    meta = {"steps": steps, "step_time_s": step_time_s, "bubble_fraction": bubble}
    written = [write_chrome_trace(run_dir / "trace.json", run_spans(recent), metadata=meta)]
    if importlib.util.find_spec("matplotlib") is not None:
        spans = run_spans(recent, waits=True, receives=False)
        written.append(plot_timeline(spans, run_dir / "timeline.png", title=title))
    return written
