"""A quick balanced cut of blocks into stages, for the planner's closed-form estimates.

`plait.plan.partition` cuts exactly (minimax under memory caps) for the plans that are
simulated; the estimates of tens of thousands of candidates use this one: a binary search
on the bottleneck with greedy packing over prefix sums.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

__all__ = ["balanced_sizes"]


def balanced_sizes(work: Sequence[float], k: int) -> list[int]:
    """Blocks per stage of a contiguous split whose heaviest stage is (nearly) lightest:
    binary search on the bottleneck with greedy packing over prefix sums (fast; the exact
    partitioner refines the plans that are simulated)."""
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    lo, hi = max(work), prefix[-1]
    for _ in range(30):
        mid = (lo + hi) / 2
        if _greedy_stages(prefix, k, mid) <= k:  # `_pack(prefix, k, mid) is not None`
            hi = mid
        else:
            lo = mid
    sizes = _pack(prefix, k, hi * (1 + 1e-9))
    assert sizes is not None and len(sizes) == k
    return sizes


def _greedy_stages(prefix: list[float], k: int, limit: float) -> int:
    """How many stages `_pack`'s greedy pass makes (k + 1: more than k), or k + 1 when
    fewer blocks than k are left to split: whether `_pack` succeeds, without its sizes."""
    n = len(prefix) - 1
    if n < k:
        return k + 1
    count = start = 0
    while start < n:
        start = max(bisect_right(prefix, prefix[start] + limit, start + 1) - 1, start + 1)
        count += 1
        if count > k:
            break
    return count


def _pack(prefix: list[float], k: int, limit: float) -> list[int] | None:
    """Greedy stages of at most `limit` work, then the largest split until there are k
    (splitting never raises the bottleneck); None when more than k stages are needed."""
    n = len(prefix) - 1
    sizes: list[int] = []
    start = 0
    while start < n:
        end = bisect_right(prefix, prefix[start] + limit, start + 1) - 1
        end = max(end, start + 1)
        sizes.append(end - start)
        start = end
        if len(sizes) > k:
            return None
    while len(sizes) < k:
        i = max(range(len(sizes)), key=sizes.__getitem__)
        if sizes[i] < 2:
            return None
        half = sizes[i] // 2
        sizes[i : i + 1] = [sizes[i] - half, half]
    return sizes
