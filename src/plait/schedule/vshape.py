"""Generators of schedules that place two stages on every rank in a V: ZB-V and Chimera.

Both put stage s on rank s for s < p and on rank 2p - 1 - s above (rank r holds stages r
and 2p - 1 - r). ZB-V runs one pipeline through all 2p stages, so the data goes down the
ranks and back up; Chimera runs two pipelines of p stages in opposite directions whose
stages at the same position are replicas of one model part (`Schedule.parts`).
"""

from __future__ import annotations

import itertools

from plait.schedule.generators import check_sizes, step_schedule
from plait.schedule.ir import Action, Op, Schedule, new_action

__all__ = ["chimera", "v_placement", "zero_bubble_v"]


def v_placement(p: int) -> tuple[int, ...]:
    """stage_to_rank of 2p stages in a V over p ranks."""
    return tuple(range(p)) + tuple(reversed(range(p)))


def _schedule(
    kind: str, p: int, m: int, programs: list[list[Action]], pipelines: tuple[tuple[int, ...], ...]
) -> Schedule:
    """The step of `programs` on stages placed in a V, each rank then updating its two."""
    return step_schedule(kind, p, m, programs, 2, stage_to_rank=v_placement(p), pipelines=pipelines)


def zero_bubble_v(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241v2, section 6):
    2p stages in a V, the backward split into BI and BW, rank r's order the published one
    (as torch's `ScheduleZBVZeroBubble` builds it): 2(p - r) - 1 forwards of its first
    stage, r pairs of forwards of both stages, p - r rounds of F, BI, BW of its second
    stage, then F, BI, BW of each stage in turn, and a cool-down of BIs then BWs.

    The paper's zero bubble assumes t_F = t_BI = t_BW and m >= 2p - 1; under those costs
    a rank holds at most as many micro-batches' activations as 1F1B's first rank. With
    fewer micro-batches the same order is cut to the micro-batches that exist (as torch
    does), leaving bubbles.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    if num_chunks != 2:
        raise ValueError(f"num_chunks={num_chunks}: ZB-V places exactly 2 stages per rank")
    p, m = num_stages, num_microbatches
    programs = [
        [a for a in _zbv_rank(p, max(2 * p - 1, m), r) if a.microbatch < m] for r in range(p)
    ]
    return _schedule("zb-v", p, m, programs, ())


def _zbv_rank(p: int, n: int, r: int) -> list[Action]:
    """Rank r's ZB-V program for n >= 2p - 1 micro-batches (its counters inlined: a
    64-stage pipeline of 512 micro-batches is 200 000 actions)."""
    first, second = r, 2 * p - 1 - r
    f, bi, bw = Op.F, Op.BI, Op.BW
    out: list[Action] = []
    put = out.append
    # the next micro-batch of forward, input gradient and weight gradient on each stage
    f1 = f2 = i1 = i2 = w1 = w2 = 0
    for _ in range(2 * (p - r) - 1):
        put(new_action(f, first, f1))
        f1 += 1
    for _ in range(r):
        put(new_action(f, second, f2))
        put(new_action(f, first, f1))
        f1, f2 = f1 + 1, f2 + 1
    for _ in range(p - r):
        put(new_action(f, second, f2))
        put(new_action(bi, second, i2))
        put(new_action(bw, second, w2))
        f2, i2, w2 = f2 + 1, i2 + 1, w2 + 1
    while f2 < f1 or f1 < n:
        if f1 < n:
            put(new_action(f, first, f1))
            f1 += 1
        put(new_action(bi, first, i1))
        put(new_action(bw, first, w1))
        put(new_action(f, second, f2))
        put(new_action(bi, second, i2))
        put(new_action(bw, second, w2))
        i1, w1, f2, i2, w2 = i1 + 1, w1 + 1, f2 + 1, i2 + 1, w2 + 1
    for _ in range(r):
        put(new_action(bi, first, i1))
        put(new_action(bi, second, i2))
        i1, i2 = i1 + 1, i2 + 1
    for _ in range(p - r):
        put(new_action(bi, first, i1))
        put(new_action(bw, first, w1))
        i1, w1 = i1 + 1, w1 + 1
    out += [new_action(bw, second, x) for x in range(w2, i2)]
    out += [new_action(bw, first, x) for x in range(w1, i1)]
    return out


def chimera(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Chimera (Li & Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks
    with Bidirectional Pipelines", SC 2021): two pipelines of p stages over the same p
    ranks, "down" (model part k on rank k: stages 0..p-1) and "up" (part k on rank
    p - 1 - k: stages p..2p-1); even micro-batches go down, odd ones up. Every rank holds
    a replica of two parts; the two replicas of a part are summed before its update, once
    per step after a flush (synchronous, as in the paper).

    The order is list scheduling in slots of equal length (the paper counts a forward and
    a backward as one slot each): at every slot a rank runs a forward whose input has
    arrived if it holds fewer than p micro-batches, else a backward whose gradient has
    arrived; lowest micro-batch first. For m a multiple of p (tested up to p = 8, m = 3p)
    the step then takes 2m + p - 2 slots, the paper's bubble ratio (p - 2)/(2m + p - 2)
    (its Table 2, (D - 2)/(2N + D - 2) with N the micro-batches per step), and a rank
    holds at most p micro-batches (the paper's D·M_a bound). The formula needs equal F and
    B slots: with a backward twice a forward no order reaches it (for p = m = 4 the best
    takes 16 units, the formula's ratio would need 15). `num_chunks` must be 1: each
    pipeline has one stage per rank.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"num_chunks={num_chunks}: each Chimera pipeline has one stage per rank")
    p, m = num_stages, num_microbatches
    pipelines = (tuple(range(p)), tuple(range(p, 2 * p)))
    return _schedule("chimera", p, m, _BidirectionalList(p, m, pipelines).run(), pipelines)


class _BidirectionalList:
    """Chimera's list scheduling under equal slots (see `chimera`)."""

    def __init__(self, p: int, m: int, pipelines: tuple[tuple[int, ...], ...]) -> None:
        self.p, self.m = p, m
        self.place = v_placement(p)
        self.before = {b: a for q in pipelines for a, b in itertools.pairwise(q)}
        self.after = {a: b for b, a in self.before.items()}
        self.todo: list[list[Action]] = [[] for _ in range(p)]
        for x in range(m):
            for s in pipelines[x % 2]:
                self.todo[self.place[s]] += [Action(Op.F, s, x), Action(Op.B, s, x)]
        self.end: dict[tuple[Op, int, int], int] = {}
        self.held = [0] * p

    def ready(self, r: int, a: Action, t: int) -> bool:
        never = t + 1
        if a.op is Op.F:
            before = self.before.get(a.stage)
            arrived = before is None or self.end.get((Op.F, before, a.microbatch), never) <= t
            return arrived and self.held[r] < self.p
        after = self.after.get(a.stage)
        done = self.end.get((Op.F, a.stage, a.microbatch), never) <= t
        return done and (after is None or self.end.get((Op.B, after, a.microbatch), never) <= t)

    def run(self) -> list[list[Action]]:
        programs: list[list[Action]] = [[] for _ in range(self.p)]
        t = 0
        while any(self.todo):
            if t > 2 * self.m * self.p + 2 * self.p:  # longer than running everything serially
                raise AssertionError(f"chimera list scheduling stalled for p={self.p} m={self.m}")
            picks = []
            for r in range(self.p):
                ready = [a for a in self.todo[r] if self.ready(r, a, t)]
                picks.append(
                    min(ready, key=lambda a: (a.op is not Op.F, a.microbatch), default=None)
                )
            for r, a in enumerate(picks):
                if a is not None:
                    self.todo[r].remove(a)
                    self.end[(a.op, a.stage, a.microbatch)] = t + 1
                    self.held[r] += 1 if a.op is Op.F else -1
                    programs[r].append(a)
            t += 1
        return programs
