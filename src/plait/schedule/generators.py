"""Generators of synchronous pipeline schedules: pure functions of integers.

Each returns a compute-only `Schedule` (forward and backward actions); `build` adds the
sends and receives with `add_communication` and validates the result, which is what the
runtime and the simulator consume.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.schedule.ir import Action, Op, Schedule
from plait.schedule.passes import add_communication
from plait.schedule.validate import ScheduleError, validate

__all__ = [
    "GENERATORS",
    "build",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zero_bubble_h1",
]


def _check(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: a pipeline needs at least 1 stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: use at least 1 micro-batch")
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks}: use at least 1 chunk per rank")


def _schedule(kind: str, p: int, m: int, programs: list[list[Action]], v: int = 1) -> Schedule:
    return Schedule(
        kind=kind,
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=tuple(s % p for s in range(p * v)),
        ranks=tuple(tuple(prog) for prog in programs),
        num_chunks=v,
    )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Each rank holds the activations of all `num_microbatches` at once; with unit costs the
    step takes (m + p - 1)(t_f + t_b), a bubble of (p - 1)/(m + p - 1). Naive model
    parallelism is this schedule with one micro-batch.
    """
    _check(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    programs = [
        [Action(Op.F, r, i) for i in range(m)] + [Action(Op.B, r, i) for i in range(m)]
        for r in range(p)
    ]
    return _schedule("gpipe", p, m, programs)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021): warm-up forwards, then alternate.

    Rank r runs min(p - r - 1, m) warm-up forwards, then one forward and one backward in
    turn, then drains. Same bubble as GPipe, but rank r holds at most p - r micro-batches.
    """
    _check(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    programs = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        prog = [Action(Op.F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            prog += [Action(Op.F, r, warmup + i), Action(Op.B, r, i)]
        prog += [Action(Op.B, r, i) for i in range(m - warmup, m)]
        programs.append(prog)
    return _schedule("1f1b", p, m, programs)


def _rounds(p: int, m: int) -> list[list[int]]:
    """Micro-batches in rounds of about p (Megatron takes exactly p; we allow any m)."""
    count = max(1, m // p)
    base, extra = divmod(m, count)
    rounds, start = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        rounds.append(list(range(start, start + size)))
        start += size
    return rounds


def _interleaved_programs(p: int, m: int, v: int, extra_warmup: int) -> list[list[Action]]:
    rounds = _rounds(p, m)
    programs = []
    for r in range(p):
        fwd = [Action(Op.F, c * p + r, i) for rnd in rounds for c in range(v) for i in rnd]
        bwd = [Action(Op.B, c * p + r, i) for rnd in rounds for c in reversed(range(v)) for i in rnd]
        warmup = min(len(fwd), (p - r - 1) * 2 + (v - 1) * len(rounds[0]) + extra_warmup)
        prog = fwd[:warmup]
        for i in range(len(fwd) - warmup):
            prog += [fwd[warmup + i], bwd[i]]
        prog += bwd[len(fwd) - warmup :]
        programs.append(prog)
    return programs


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each rank holds `num_chunks`
    virtual stages (stage s on rank s mod p), which shrinks the bubble to
    (p - 1)/(v·m + p - 1) at the price of v times more point-to-point messages.

    Micro-batches go in rounds of p as in Megatron; when m is not a multiple of p the
    rounds are made as equal as possible, and the warm-up is lengthened by the least
    amount that keeps the program free of deadlock (the validator decides).
    """
    _check(num_stages, num_microbatches, num_chunks)
    if num_chunks < 2:
        raise ValueError(f"num_chunks={num_chunks}: interleaving needs >= 2 chunks; use 1f1b")
    p, m, v = num_stages, num_microbatches, num_chunks
    for extra in range(m * v + 1):
        schedule = _schedule("interleaved", p, m, _interleaved_programs(p, m, v, extra), v)
        try:
            validate(schedule)
            return schedule
        except ScheduleError:
            continue
    raise AssertionError("all-forward-first interleaving is always valid")


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

    The backward is split into BI (gradients for the stage inputs, on the critical path)
    and BW (gradients for the weights, free to move). Forwards and BIs follow 1F1B; each
    BW runs as soon as the rank would otherwise idle, or when the rank already holds p
    micro-batches, so the peak memory stays 1F1B's (p on the first rank). Built by list
    scheduling under unit costs (t_F = t_BI = t_BW), where its bubble is about a third of
    1F1B's: (p - 1)(t_F + t_BI - t_BW) instead of (p - 1)(t_F + t_BI + t_BW).
    """
    _check(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    f_end: dict[tuple[int, int], int] = {}
    bi_end: dict[tuple[int, int], int] = {}
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    programs: list[list[Action]] = [[] for _ in range(p)]
    busy_until = [0] * p
    t = 0
    while any(nw[r] < m for r in range(p)):
        for r in range(p):
            if busy_until[r] > t:
                continue
            action = _zb_pick(r, t, p, m, nf, nb, nw, f_end, bi_end)
            if action is None:
                continue
            programs[r].append(action)
            busy_until[r] = t + 1
            if action.op is Op.F:
                f_end[(r, action.microbatch)] = t + 1
                nf[r] += 1
            elif action.op is Op.BI:
                bi_end[(r, action.microbatch)] = t + 1
                nb[r] += 1
            else:
                nw[r] += 1
        t += 1
    return _schedule("zb-h1", p, m, programs)


def _zb_pick(
    r: int,
    t: int,
    p: int,
    m: int,
    nf: list[int],
    nb: list[int],
    nw: list[int],
    f_end: dict[tuple[int, int], int],
    bi_end: dict[tuple[int, int], int],
) -> Action | None:
    def done(table: dict[tuple[int, int], int], key: tuple[int, int]) -> bool:
        return table.get(key, t + 1) <= t

    i = nb[r]
    if i < nf[r] and (r == p - 1 or done(bi_end, (r + 1, i))):
        return Action(Op.BI, r, i)
    j = nf[r]
    may_forward = j < m and j - nb[r] < p - r and j - nw[r] < p
    if may_forward and (r == 0 or done(f_end, (r - 1, j))):
        return Action(Op.F, r, j)
    if nw[r] < nb[r]:
        return Action(Op.BW, r, nw[r])
    return None


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
}


def build(kind: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """The validated, communication-lowered schedule of `kind`, ready to run or simulate."""
    if kind not in GENERATORS:
        raise ValueError(f"schedule kind {kind!r} is unknown; choose one of {sorted(GENERATORS)}")
    if kind == "interleaved":
        schedule = interleaved_1f1b(num_stages, num_microbatches, num_chunks)
    else:
        if num_chunks != 1:
            raise ValueError(f"chunks={num_chunks} applies only to 'interleaved'; use chunks=1")
        schedule = GENERATORS[kind](num_stages, num_microbatches)
    lowered = add_communication(schedule)
    validate(lowered)
    return lowered
