"""Timelines for people: Chrome/Perfetto trace files and PNG Gantt charts, side by side."""

from plait.trace.chrome import chrome_trace, write_chrome_trace
from plait.trace.gantt import COLORS, plot_comparison, plot_timeline
from plait.trace.run import run_spans, write_run_timeline
from plait.trace.spans import (
    KINDS,
    Span,
    kind_of,
    spans_from_records,
    spans_from_timeline,
)

__all__ = [
    "COLORS",
    "KINDS",
    "Span",
    "chrome_trace",
    "kind_of",
    "plot_comparison",
    "plot_timeline",
    "run_spans",
    "spans_from_records",
    "spans_from_timeline",
    "write_chrome_trace",
    "write_run_timeline",
]
