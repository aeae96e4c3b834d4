"""What a schedule kind holds on each pipeline rank at its peak (the registry's closed forms)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from plait.schedule import schedule_kind

__all__ = ["held", "inflight", "least_held"]


def inflight(kind: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches (in whole-stage units) whose activations `rank` holds at its peak."""
    return schedule_kind(kind).inflight(p, m, v, rank)


@lru_cache(maxsize=4096)
def held(kind: str, p: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Per pipeline rank: in-flight micro-batches at the peak and weight copies (the
    registry's closed forms), kept read-only: tens of thousands of candidates share a
    few hundred (kind, p, m, v)."""
    entry = schedule_kind(kind)
    counts = np.array([entry.inflight(p, m, v, r) for r in range(p)], dtype=float)
    copies = np.array([entry.copies(p, m, r) for r in range(p)], dtype=float)
    counts.flags.writeable = copies.flags.writeable = False
    return counts, copies


@lru_cache(maxsize=4096)
def least_held(kind: str, p: int, m: int, v: int) -> tuple[float, float]:
    """(the fewest in-flight micro-batches, the fewest weight copies) of any rank."""
    counts, copies = held(kind, p, m, v)
    return float(counts.min()), float(copies.min())
