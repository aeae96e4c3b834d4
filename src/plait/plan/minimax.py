"""The minimax contiguous split at the heart of `plait.plan.partition`: the cut points of n
blocks into k stages whose costliest stage is cheapest, every stage fitting.

`minimax` is the generic dynamic programme over any cost and fit; `minimax_blocks` the
same comparisons inlined for `partition`'s seconds and memory (the planner cuts hundreds
of models of 100+ blocks), its rows priced over arrays where blocks far outnumber stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["Segment", "minimax", "minimax_blocks"]

Segment = Callable[[int, int, int], float]  # (stage, first block, end block) -> value


def minimax(n: int, k: int, cost: Segment, fits: Callable[[int, int, int], bool]) -> list[int]:
    """Cut points minimising the largest `cost` of a stage, every stage `fits`; [] if none.

    Relies on `cost` and the failure of `fits` only growing as a segment grows."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for i in range(1, k + 1):
        for j in range(i, n - (k - i) + 1):
            for start in range(j - 1, i - 2, -1):
                if not fits(i - 1, start, j):
                    break
                here = cost(i - 1, start, j)
                if here >= best[i][j]:
                    break
                value = max(best[i - 1][start], here)
                if value < best[i][j]:
                    best[i][j], choice[i][j] = value, start
    return _cuts(best, choice, k, n)


def minimax_blocks(
    k: int,
    time_sum: list[float],
    speed: list[float],
    static_sum: list[float],
    act_sum: list[float],
    held: Sequence[float],
    limit: list[float],
) -> list[int]:
    """`minimax` for `partition`'s own cost (seconds) and fit (memory within `limit`),
    inlined: the same comparisons on the same floats, so the same cuts, without two calls
    per candidate segment (the planner cuts hundreds of models of 100+ blocks)."""
    n = len(time_sum) - 1
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    arrays = [np.array(x) for x in (time_sum, static_sum, act_sum)]
    for i in range(1, k + 1):
        pace, hold, cap = speed[i - 1], held[i - 1], limit[i - 1]
        before, row, chosen = best[i - 1], best[i], choice[i]
        if n - k >= _MANY:  # many ends, long segments: every (end, start) at once
            _minimax_row(i, k, arrays, before, row, chosen, pace, hold, cap)
            continue
        for j in range(i, n - (k - i) + 1):
            t_end, s_end, a_end = time_sum[j], static_sum[j], act_sum[j]
            top = inf
            for start in range(j - 1, i - 2, -1):
                if not s_end - static_sum[start] + hold * (a_end - act_sum[start]) <= cap:
                    break
                here = (t_end - time_sum[start]) / pace
                if here >= top:
                    break
                value = before[start] if before[start] > here else here
                if value < top:
                    top, chosen[j] = value, start
            row[j] = top
    return _cuts(best, choice, k, n)


# from this many more blocks than stages, `minimax_blocks` prices its rows over arrays
_MANY = 16


def _cuts(best: list[list[float]], choice: list[list[int]], k: int, n: int) -> list[int]:
    """The cut points the programme chose, back from the last stage ([] when none fits)."""
    if best[k][n] == math.inf:
        return []
    cuts = [n]
    for i in range(k, 0, -1):
        cuts.append(choice[i][cuts[-1]])
    return cuts[::-1]


def _minimax_row(
    i: int,
    k: int,
    arrays: list[np.ndarray],
    before: list[float],
    row: list[float],
    chosen: list[int],
    pace: float,
    hold: float,
    cap: float,
) -> None:
    """Row i of `minimax_blocks` over arrays: for each end, the latest start of the least
    max(before[start], stage seconds) among starts whose stage fits (the scan's answer)."""
    time_sum, static_sum, act_sum = arrays
    n = len(time_sum) - 1
    ends = np.arange(i, n - (k - i) + 1)[:, None]
    starts = np.arange(i - 1, n - (k - i))[None, :]
    seconds = (time_sum[ends] - time_sum[starts]) / pace
    memory = static_sum[ends] - static_sum[starts] + hold * (act_sum[ends] - act_sum[starts])
    value = np.maximum(np.array(before)[starts], seconds)
    value[~((starts < ends) & (memory <= cap))] = math.inf
    last = value.shape[1] - 1 - value[:, ::-1].argmin(axis=1)  # the latest of the least
    least = value[np.arange(len(last)), last]
    for j, top, start in zip(ends[:, 0].tolist(), least.tolist(), last.tolist(), strict=True):
        row[j] = top
        if top < math.inf:
            chosen[j] = start + i - 1
