"""Making a worker slower on purpose: a device marked `slowdown = k` in a cluster file
(`plait.cluster.Device`) is emulated by padding each of its ranks' steps with (k − 1) ×
the time the step spent computing (its forward and backward actions), so heterogeneous
plans (HetPipe, WSP) can be tried and measured on one machine of equal CPU cores.

The pad is a sleep, not repeated arithmetic: a slow device takes no compute from its
neighbours. Compute time is wall time, waits for peers excluded: on cores that the
workers share it includes waiting for a core, which a slower device would wait too.

Limits: the pad comes at the end of the rank's step rather than after each action, so in
a pipeline of several ranks the neighbours see the delay at the next step's first
message, not in the bubble of this one (exact for one-rank pipelines).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

from plait.runtime.executor import ActionRecord

__all__ = ["compute_seconds", "pad_step"]

_COMPUTE = ("F", "B", "BI", "BW")
_LABEL = re.compile(r"^\d+([A-Z]+)\d+")  # stage, op, micro-batch (`plait.schedule.ir`)


def compute_seconds(records: Iterable[ActionRecord]) -> float:
    """Seconds a rank spent in forward and backward actions (labels such as `0F3`)."""
    total = 0.0
    for r in records:
        match = _LABEL.match(r.label)
        if match is not None and match.group(1) in _COMPUTE:
            total += r.end - r.start
    return total


def pad_step(records: Iterable[ActionRecord], slowdown: float) -> float:
    """Sleep (slowdown − 1) × the compute time of `records`; return the seconds slept."""
    if slowdown <= 1.0:
        return 0.0
    pad = (slowdown - 1.0) * compute_seconds(records)
    time.sleep(pad)
    return pad
