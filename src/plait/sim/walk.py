"""What one pass over a rank's replayed times learns: its peaks and its work per window.

The simulator replays a schedule (`plait.schedule.replay`), then reads each rank's start and
end times once. `walk` does that with numpy over the times as arrays; `walk_events` is the
same read event by event, the reference `walk` is tested against. A planner replays runs of
hundreds of thousands of actions, where the loop cost as much as a fifth of the replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plait.schedule import Action, Op, Replay, Unrolled

__all__ = ["Walk", "walk", "walk_events"]

_WEIGHTS = (Op.UPDATE, Op.STASH, Op.PREDICT, Op.FREE)
_CODE = {op: i for i, op in enumerate(Op)}
_COMPUTE_CODES = [_CODE[op] for op in (Op.F, Op.B, Op.BW, Op.BI)]
_WEIGHT_CODES = [_CODE[op] for op in _WEIGHTS]
_SEND_CODES = [_CODE[Op.SEND_F], _CODE[Op.SEND_B]]
# per program (by identity, the program kept alive beside its codes): op codes and stages
_CODES: dict[int, tuple[tuple[Action, ...], np.ndarray, np.ndarray]] = {}
_KEPT = 1024  # programs: a few large schedules (each holds its programs alive)


@dataclass
class Walk:
    """What one pass over a rank's events learns: peaks over the whole run, and the seconds
    per window of each kind of work, averaged over the steady windows."""

    busy: float = 0.0  # forward and backward work
    p2p: float = 0.0
    reduce: float = 0.0
    update: float = 0.0  # optimizer steps and weight copies
    compute_end: float = 0.0
    end: float = 0.0
    activation_peak: float = 0.0
    copies_peak: float = 0.0


def _codes(program: tuple[Action, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A program's op codes and stages as arrays, kept: the planner replays the few
    schedules it builds (`plait.sim.build_schedule` keeps them) many times."""
    kept = _CODES.get(id(program))
    if kept is not None and kept[0] is program:
        return kept[1], kept[2]
    if len(_CODES) > _KEPT:
        _CODES.clear()
    ops = np.fromiter((_CODE[a.op] for a in program), dtype=np.int8, count=len(program))
    stages = np.fromiter((a.stage for a in program), dtype=np.int64, count=len(program))
    _CODES[id(program)] = (program, ops, stages)
    return ops, stages


def _running_peak(signs: tuple[np.ndarray, np.ndarray], sizes: np.ndarray) -> float:
    """The largest running total, read where it grows, of + sizes where `signs[0]` and
    - sizes where `signs[1]` (in order, as a loop adds them), and at least 0."""
    grow, shrink = signs
    total = np.cumsum(np.where(grow, sizes, np.where(shrink, -sizes, 0.0)))
    return max(0.0, float(total[grow].max(initial=0.0)))


def walk(
    rank: int,
    result: Replay,
    unrolled: Unrolled,
    first: int,
    saved: Sequence[float],
    copy: Sequence[float],
) -> Walk:
    """Rank `rank`'s peaks over the whole run and work per window over windows `first`
    onwards; `saved[s]` is the bytes a forward of stage s holds until its backward frees
    them, `copy[s]` the bytes of one copy of its weights. Exact to the last bit against
    `walk_events`: every sum is sequential (`cumsum`) in program order, as the loop adds,
    and a masked-out 0.0 changes no sum."""
    n = len(result.starts[rank])
    ops, stages = _codes(unrolled.schedule.ranks[rank])
    ops, stages = ops[:n], stages[:n]
    starts, ends = np.asarray(result.starts[rank]), np.asarray(result.ends[rank])
    out = Walk()
    forward, freed = ops == _CODE[Op.F], np.isin(ops, [_CODE[Op.B], _CODE[Op.BW]])
    out.activation_peak = _running_peak((forward, freed), np.asarray(saved)[stages])
    kept = np.isin(ops, [_CODE[Op.STASH], _CODE[Op.PREDICT]])
    out.copies_peak = _running_peak((kept, ops == _CODE[Op.FREE]), np.asarray(copy)[stages])
    out.end = max(0.0, float(ends.max(initial=0.0)))
    marks = unrolled.starts[rank]
    lo, hi = marks[first], min(marks[unrolled.num_windows], n)
    took, op = ends[lo:hi] - starts[lo:hi], ops[lo:hi]
    compute = np.isin(op, _COMPUTE_CODES)
    if compute.any():
        out.compute_end = float(ends[lo:hi][compute][-1])
    windows = max(1, unrolled.num_windows - first)
    masks = {"busy": compute, "update": np.isin(op, _WEIGHT_CODES),
             "reduce": op == _CODE[Op.REDUCE], "p2p": np.isin(op, _SEND_CODES)}  # fmt: skip
    for name, mask in masks.items():
        total = float(np.cumsum(np.where(mask, took, 0.0))[-1]) if len(took) else 0.0
        setattr(out, name, total / windows)
    if result.sends:  # a compute-only replay: its sends beside the program, in order
        at, begun, landed = map(np.asarray, result.sends[rank])
        out.end = max(out.end, float(landed.max(initial=0.0)))
        inside = (at >= lo) & (at < hi)
        took = landed[inside] - begun[inside]
        out.p2p = (float(np.cumsum(took)[-1]) if len(took) else 0.0) / windows
    return out


def walk_events(
    rank: int,
    result: Replay,
    unrolled: Unrolled,
    first: int,
    saved: Sequence[float],
    copy: Sequence[float],
) -> Walk:
    """`walk`, event by event (the reference)."""
    f, b, bw, bi = Op.F, Op.B, Op.BW, Op.BI
    marks = unrolled.starts[rank]
    lo, hi = marks[first], marks[unrolled.num_windows]
    out = Walk()
    held = copies = 0.0
    for e in result.events[rank]:  # a compute-only replay's sends: their producer's index
        action = e.action
        op, counted = action.op, lo <= e.index < hi
        if op is f:
            held += saved[action.stage]
            out.activation_peak = max(out.activation_peak, held)
        elif op is b or op is bw:
            held -= saved[action.stage]
        elif op is Op.STASH or op is Op.PREDICT:
            copies += copy[action.stage]
            out.copies_peak = max(out.copies_peak, copies)
        elif op is Op.FREE:
            copies -= copy[action.stage]
        out.end = max(out.end, e.end)
        if not counted:
            continue
        took = e.end - e.start
        if op is f or op is b or op is bw or op is bi:
            out.busy += took
            out.compute_end = e.end
        elif op in _WEIGHTS:
            out.update += took
        elif op is Op.REDUCE:
            out.reduce += took
        elif op is Op.SEND_F or op is Op.SEND_B:
            out.p2p += took
    windows = max(1, unrolled.num_windows - first)
    for name in ("busy", "p2p", "reduce", "update"):
        setattr(out, name, getattr(out, name) / windows)
    return out
