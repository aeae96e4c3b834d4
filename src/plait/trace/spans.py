"""Timeline spans: the one shape predicted and measured timelines take before they are drawn.

A `Span` is one action on one rank with its start and end in seconds and a `kind` for
colouring: `F`, `B`, `BI`, `BW` (compute), `comm` (sends, receives, gradient reduction),
`optimizer`, or `wait` (a measured action waiting for its input). The simulator's
`TimelineEvent`s and the runtime's `ActionRecord`s are read by attribute (rank, label,
start, end, and `wait` for records), so this package imports neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "KINDS",
    "Span",
    "kind_of",
    "spans_from_records",
    "spans_from_timeline",
]

#: Every kind a span may have, in legend order.
KINDS: tuple[str, ...] = ("F", "B", "BI", "BW", "comm", "optimizer", "wait")

_ACTION = re.compile(r"^(\d+)([A-Z_]+?)(-?\d+)(v-?\d+)?$")
_COMM = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE"}
_OPTIMIZER = {"UPDATE", "STASH", "PREDICT", "FREE"}  # optimizer steps and weight copies


@dataclass(frozen=True, slots=True)
class Span:
    """One action on one rank, in seconds from the start of the step."""

    rank: int
    label: str
    start: float
    end: float
    kind: str
    step: int | None = None  # the training step a measured span belongs to, when known

    @property
    def duration(self) -> float:
        return self.end - self.start


class _Event(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def label(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


def kind_of(label: str) -> str:
    """The kind of an action label: `2F0` is F, `1SEND_B3` and `0REDUCE3` comm, `0UPDATE3v1`
    and `OPT` optimizer, `0DP` comm."""
    match = _ACTION.match(label)
    if match:
        op = match.group(2)
        if op in _OPTIMIZER:
            return "optimizer"
        return "comm" if op in _COMM else op if op in KINDS else "comm"
    if label.startswith("OPT"):
        return "optimizer"
    return "comm"


def spans_from_timeline(timeline: Iterable[Iterable[_Event]]) -> list[Span]:
    """Spans of a predicted timeline (`SimResult.timeline`: per rank, events)."""
    return [
        Span(e.rank, e.label, e.start, e.end, kind_of(e.label)) for row in timeline for e in row
    ]


def spans_from_records(
    records: Iterable[Iterable[_Event]],
    *,
    offsets: Sequence[float] | None = None,
    waits: bool = True,
    receives: bool = False,
    step: int | None = None,
) -> list[Span]:
    """Spans of a measured step (per rank, the runtime's `ActionRecord`s). `offsets[r]` is
    added to rank r's times (ranks time from their own start; pass each rank's start minus
    the earliest to share one clock). A record's `wait` becomes a `wait` span before it;
    posted receives (instantaneous) are left out unless `receives`; `step` tags every span."""
    out: list[Span] = []
    for rank_index, row in enumerate(records):
        shift = offsets[rank_index] if offsets is not None else 0.0
        for r in row:
            kind = kind_of(r.label)
            if not receives and "RECV" in r.label:
                continue
            wait = float(getattr(r, "wait", 0.0))
            if waits and wait > 0:
                out.append(Span(r.rank, f"wait {r.label}", r.start - wait + shift, r.start + shift,
                                "wait", step))  # fmt: skip
            out.append(Span(r.rank, r.label, r.start + shift, r.end + shift, kind, step))
    return out
