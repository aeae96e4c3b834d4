"""Generators of synchronous pipeline schedules: pure functions of integers.

Each returns a compute-only `Schedule`: one training step as one window, its forward and
backward actions and, at the end of each rank's program, one UPDATE per stage (every
stage's optimizer step after the flush). `plait.schedule.registry.build` adds the
gradient reductions and the sends and receives and validates the result, which is what
the runtime and the simulator consume.
"""

from __future__ import annotations

from plait.schedule.ir import Action, Op, Schedule, new_action
from plait.schedule.replay import replay

__all__ = [
    "check_sizes",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zero_bubble_h1",
    "zero_bubble_h2",
]


def check_sizes(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: a pipeline needs at least 1 stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: use at least 1 micro-batch")
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks}: use at least 1 chunk per rank")


def step_schedule(
    kind: str,
    p: int,
    m: int,
    programs: list[list[Action]],
    v: int = 1,
    *,
    stage_to_rank: tuple[int, ...] | None = None,
    pipelines: tuple[tuple[int, ...], ...] = (),
) -> Schedule:
    """The step of `programs`, each rank then updating its stages (in stage order); the
    `v` stages per rank placed round-robin unless `stage_to_rank` says otherwise."""
    place = stage_to_rank or tuple(s % p for s in range(p * v))
    updated = [
        [*prog, *(Action(Op.UPDATE, s, m - 1, 1) for s, q in enumerate(place) if q == r)]
        for r, prog in enumerate(programs)
    ]
    return Schedule(
        kind=kind,
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=place,
        ranks=tuple(tuple(prog) for prog in updated),
        num_chunks=v,
        pipelines=pipelines,
    )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Each rank holds the activations of all `num_microbatches` at once; with unit costs the
    step takes (m + p - 1)(t_f + t_b), a bubble of (p - 1)/(m + p - 1). Naive model
    parallelism is this schedule with one micro-batch.
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    programs = [
        [new_action(Op.F, r, i) for i in range(m)] + [new_action(Op.B, r, i) for i in range(m)]
        for r in range(p)
    ]
    return step_schedule("gpipe", p, m, programs)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021): warm-up forwards, then alternate.

    Rank r runs min(p - r - 1, m) warm-up forwards, then one forward and one backward in
    turn, then drains. Same bubble as GPipe, but rank r holds at most p - r micro-batches.
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    programs = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        prog = [new_action(Op.F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            prog += [new_action(Op.F, r, warmup + i), new_action(Op.B, r, i)]
        prog += [new_action(Op.B, r, i) for i in range(m - warmup, m)]
        programs.append(prog)
    return step_schedule("1f1b", p, m, programs)


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
        fwd = [new_action(Op.F, c * p + r, i) for rnd in rounds for c in range(v) for i in rnd]
        bwd = [
            new_action(Op.B, c * p + r, i)
            for rnd in rounds
            for c in reversed(range(v))
            for i in rnd
        ]
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
    amount that keeps the program free of deadlock (abstract execution decides; `build`
    then validates the lowered result in full). The bubble formula holds when p divides m;
    otherwise the step is longer and rank 0 may hold up to v·m micro-batches.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    if num_chunks < 2:
        raise ValueError(f"num_chunks={num_chunks}: interleaving needs >= 2 chunks; use 1f1b")
    p, m, v = num_stages, num_microbatches, num_chunks
    for extra in range(m * v + 1):
        schedule = step_schedule("interleaved", p, m, _interleaved_programs(p, m, v, extra), v)
        # The programs cover every action in a legal local order by construction, so only
        # deadlock can go wrong: replay alone decides, without the validator's other checks.
        if replay(schedule).completed:
            return schedule
    raise AssertionError("all-forward-first interleaving is always valid")


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

    The backward is split into BI (gradients for the stage inputs, on the critical path)
    and BW (gradients for the weights, free to move). Built by list scheduling under unit
    costs (t_F = t_BI = t_BW = 1): at every time step each rank runs, in this order of
    preference, the next forward if 1F1B's limit allows it (rank r holds fewer than p - r
    micro-batches between F and BI) and the rank holds fewer than p micro-batches in all
    (F to BW); else the next BI whose gradients have arrived; else the oldest pending BW.
    Forwards first keep the last rank fed; BWs fill what would be idle time.

    Measured for p <= 16 and m <= 4p + 2 (tested for p <= 8): the unit-cost step takes
    3m + p - 1 when m >= p, the paper's ZB-H1 bubble (p - 1)(t_F + t_BI - t_BW) against
    1F1B's (p - 1)(t_F + t_BI + t_BW); it takes 2m + 2p - 1 when m < p. Every rank holds
    at most min(p, m) micro-batches: the peak of 1F1B's first rank, reached on every rank.
    With unequal costs the order stays the same but is no longer optimal.
    """
    check_sizes(num_stages, num_microbatches)
    p = num_stages
    return _zero_bubble("zb-h1", p, num_microbatches, [p - r for r in range(p)], p)


def zero_bubble_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.2).

    ZB-H1's list scheduling with the memory limit raised so that more forwards fill the
    warm-up: rank r holds up to 2(p - r) - 1 micro-batches between F and BI, and up to
    2p - 1 between F and BW (the paper's peak of (2p - 1) micro-batches' activations, on
    every rank). Under unit costs (t_F = t_BI = t_BW = 1) and m >= 2p - 1, rank r then
    computes without a gap from time r to r + 3m: the paper's ZB-H2 bubble
    (p - 1)(t_F + t_BI - 2 t_BW) = 0 inside each rank's span. With the optimizer step
    after a flush the step still takes 3m + p - 1 (rank p - 1 cannot start before p - 1
    forwards have reached it), as ZB-H1's; the paper's zero-bubble step also needs its
    "post-validation" optimizer, which lets rank 0 start the next step at 3m and which
    plait does not do. With m < 2p - 1 the warm-up is shorter and gaps remain.
    """
    check_sizes(num_stages, num_microbatches)
    p = num_stages
    limits = [2 * (p - r) - 1 for r in range(p)]
    return _zero_bubble("zb-h2", p, num_microbatches, limits, 2 * p - 1)


def _zero_bubble(kind: str, p: int, m: int, to_bi: list[int], to_bw: int) -> Schedule:
    """List scheduling of a split backward under unit costs (see `zero_bubble_h1`): rank
    r holds at most `to_bi[r]` micro-batches between F and BI and `to_bw` between F and BW."""
    state = _ZeroBubbleState(p, m, to_bi, to_bw)
    t = 0
    while state.remaining:
        if t > 3 * m * p + p:  # longer than running everything serially
            raise AssertionError(f"{kind} list scheduling made no progress for p={p} m={m}")
        picks = [state.pick(r, t) for r in range(p)]  # all decided on the state at t
        for r, op in enumerate(picks):
            if op is not None:
                state.run(r, op, t)
        t += 1
    return step_schedule(kind, p, m, state.programs)


# Enum members looked up once: `Op.F` costs a class attribute look-up each time.
_OP_F, _OP_BI, _OP_BW = Op.F, Op.BI, Op.BW


class _ZeroBubbleState:
    """Progress of a zero-bubble list scheduling: per rank, counts and end times of F, BI,
    BW, and the limits on micro-batches held (`_zero_bubble`)."""

    def __init__(self, p: int, m: int, to_bi: list[int], to_bw: int) -> None:
        self.p, self.m = p, m
        self.to_bi, self.to_bw = to_bi, to_bw
        never = 3 * m * p + p + 2  # a time later than any step
        self.f_end = [[never] * m for _ in range(p)]
        self.bi_end = [[never] * m for _ in range(p)]
        self.nf, self.nbi, self.nbw = [0] * p, [0] * p, [0] * p
        self.programs: list[list[Action]] = [[] for _ in range(p)]
        self.remaining = p * m  # BWs still to run

    def pick(self, r: int, t: int) -> Op | None:
        p, m = self.p, self.m
        j, i, w = self.nf[r], self.nbi[r], self.nbw[r]
        if (
            j < m
            and j - i < self.to_bi[r]
            and j - w < self.to_bw
            and (r == 0 or self.f_end[r - 1][j] <= t)
        ):
            return _OP_F
        if i < j and (r == p - 1 or self.bi_end[r + 1][i] <= t):
            return _OP_BI
        return _OP_BW if w < i else None

    def run(self, r: int, op: Op, t: int) -> None:
        if op is _OP_F:
            mb = self.nf[r]
            self.f_end[r][mb] = t + 1
            self.nf[r] += 1
        elif op is _OP_BI:
            mb = self.nbi[r]
            self.bi_end[r][mb] = t + 1
            self.nbi[r] += 1
        else:
            mb = self.nbw[r]
            self.nbw[r] += 1
            self.remaining -= 1
        self.programs[r].append(new_action(op, r, mb))
