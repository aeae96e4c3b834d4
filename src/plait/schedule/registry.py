"""The schedule kinds plait knows, one entry each: what the CLI offers, the config accepts,
the planner searches and the simulator builds all come from here.

`build(kind, stages, micro-batches, chunks)` is what everything runs: the kind's
generator, then the gradient reductions and the sends and receives (`plait.schedule.
passes`), then the validator. Adding a schedule is one generator and one entry below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import ceil

from plait.schedule import asynchronous as asy
from plait.schedule import generators as gen
from plait.schedule import vshape
from plait.schedule.ir import Schedule
from plait.schedule.passes import add_communication, add_reductions
from plait.schedule.pause import gc_paused
from plait.schedule.validate import validate

__all__ = ["KINDS", "ScheduleKind", "build", "kind_names", "schedule_kind"]

Generator = Callable[[int, int, int], Schedule]  # (stages, micro-batches, chunks)
Inflight = Callable[[int, int, int, int], float]  # (p, m, chunks, rank) -> micro-batches
PerStage = Callable[[int, int, int], int]  # (p, m, stage) -> count
Bubble = Callable[[int, int, int], float]  # (p, m, chunks) -> share of 1F1B's idle time


def _full(p: int, m: int, v: int) -> float:
    return 1.0


def _one(p: int, m: int, s: int) -> int:
    return 1


def _none(p: int, m: int, s: int) -> int:
    return 0


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule kind: how to generate it and what the rest of plait must know of it."""

    name: str
    generate: Generator
    policy: str  # plait.schedule.ir.POLICIES
    summary: str  # one line, for --help and explanations
    inflight: Inflight  # activations a rank holds at its peak, in whole-stage micro-batches
    chunked: bool = False  # takes num_chunks >= 2 virtual stages per rank
    split_backward: bool = False  # runs BI and BW apart (zero-bubble)
    per_microbatch: bool = False  # an UPDATE per micro-batch, not per window
    # weight versions alive at once on stage s, and copies besides the live weights (the
    # closed forms of plait.schedule.asynchronous; the tests check them against validate)
    versions: PerStage = _one
    copies: PerStage = _none
    staleness: str = ""  # what an asynchronous kind's stale weights cost, for explanations
    exact_chunks: int = 0  # the only num_chunks a chunked kind takes (0: any >= 2)
    # whether the planner searches it unless asked (its estimates model the kind)
    searched: bool = True
    # several pipelines run replicas of the same parts (Schedule.parts), summed per step
    replicated: bool = False
    # the share of 1F1B's fill-and-drain idle time, (p - 1) stage-steps, that the kind
    # leaves, with forward, input-gradient and weight-gradient passes of equal cost (the
    # papers' closed forms); the planner's estimates order candidates by it
    bubble: Bubble = _full

    @property
    def synchronous(self) -> bool:
        """Whether one window is one flushed step (every stage on its current weights)."""
        return self.policy == "sync"

    @property
    def default_chunks(self) -> int:
        return self.exact_chunks or (2 if self.chunked else 1)

    def unsupported(self, *, tp: int, zero: int, dtype: str) -> str | None:
        """Why this kind cannot run with tensor degree `tp`, ZeRO stage `zero` and `dtype`
        (weight copies per stage, each stage updating at its own time; replicas of a part
        summed), or None; the reason begins with what kind of schedule it is."""
        if self.replicated:
            why = self._unsupported_replicas(tp=tp, zero=zero)
            return None if why is None else f"(replicated stages) with {why}"
        if self.synchronous:
            return None
        why = self._unsupported_copies(tp=tp, zero=zero, dtype=dtype)
        return None if why is None else f"(asynchronous) with {why}"

    @staticmethod
    def _unsupported_replicas(*, tp: int, zero: int) -> str | None:
        if tp > 1:
            return f"tp={tp}: the sum of a part's replicas runs on whole tensors; use tp=1"
        if zero >= 2:
            return f"zero={zero}: FSDP-sharded replicas are not summed; use zero<=1"
        return None

    def _unsupported_copies(self, *, tp: int, zero: int, dtype: str) -> str | None:
        if tp > 1:
            return f"tp={tp}: weight copies of tensor-parallel shards are not supported; use tp=1"
        if zero >= 2:
            return f"zero={zero}: FSDP-sharded weights cannot be copied per version; use zero<=1"
        if zero == 1 and self.policy == "predict":
            return "zero=1: predicting weights needs the whole optimizer state; use zero=0"
        if dtype == "fp16":
            return (
                "dtype='fp16': loss scaling needs a global inf check per update, which stages "
                "updating at different times cannot share; use bf16"
            )
        return None

    def chunks(self, num_chunks: int | None) -> int:
        """`num_chunks`, or the default; an error for chunks this kind does not take."""
        if num_chunks is None:
            return self.default_chunks
        if self.exact_chunks and num_chunks != self.exact_chunks:
            raise ValueError(
                f"chunks={num_chunks}: {self.name} places exactly {self.exact_chunks} stages "
                f"on each rank; use chunks={self.exact_chunks}"
            )
        if self.chunked and num_chunks < 2:
            raise ValueError(
                f"chunks={num_chunks}: {self.name} needs >= 2 virtual stages per rank; or use 1f1b"
            )
        if not self.chunked and num_chunks != 1:
            chunked = [k.name for k in KINDS.values() if k.chunked]
            raise ValueError(f"chunks={num_chunks} applies only to {chunked}; use chunks=1")
        return num_chunks


def _interleaved_inflight(p: int, m: int, v: int, rank: int) -> float:
    """Megatron's interleaved warm-up, plus one, in chunks of 1/v stage."""
    return min(m * v, (p - rank - 1) * 2 + (v - 1) * min(p, m) + 1) / v


_STALE = "stage s computes on weights {} (see `plait experiment staleness`)"

KINDS: dict[str, ScheduleKind] = {
    k.name: k
    for k in (
        ScheduleKind(
            "gpipe",
            lambda p, m, v: gen.gpipe(p, m),
            "sync",
            "GPipe: all forwards, then all backwards",
            lambda p, m, v, r: float(m),
        ),
        ScheduleKind(
            "1f1b",
            lambda p, m, v: gen.one_f_one_b(p, m),
            "sync",
            "1F1B (PipeDream-Flush): warm-up, then one forward and one backward in turn",
            lambda p, m, v, r: float(min(p - r, m)),
        ),
        ScheduleKind(
            "interleaved",
            gen.interleaved_1f1b,
            "sync",
            "interleaved 1F1B: several virtual stages per rank, a smaller bubble",
            _interleaved_inflight,
            chunked=True,
            # Narayanan et al. 2021: the bubble shrinks by v once every rank has work
            bubble=lambda p, m, v: 1.0 / v if m >= p else 1.0,
        ),
        ScheduleKind(
            "zb-h1",
            lambda p, m, v: gen.zero_bubble_h1(p, m),
            "sync",
            "ZB-H1: backward split into input and weight halves that fill the bubble",
            lambda p, m, v, r: float(min(p, m)),
            split_backward=True,
            # Qi et al. 2024: (p - 1)(F + B - W) against 1F1B's (p - 1)(F + B + W)
            bubble=lambda p, m, v: 1 / 3 if m >= p else 1.0,
        ),
        ScheduleKind(
            "zb-h2",
            lambda p, m, v: gen.zero_bubble_h2(p, m),
            "sync",
            "ZB-H2: zero-bubble split backward with up to 2p-1 micro-batches in flight",
            lambda p, m, v, r: float(min(2 * p - 1, m)),
            split_backward=True,
            # no bubble once 2p - 1 micro-batches fill it; ZB-H1's with fewer
            bubble=lambda p, m, v: 0.0 if m >= 2 * p - 1 else 1 / 3 if m >= p else 1.0,
        ),
        ScheduleKind(
            "zb-v",
            vshape.zero_bubble_v,
            "sync",
            "ZB-V: zero-bubble split backward on two stages per rank placed in a V",
            lambda p, m, v, r: float(min(p, m)),
            chunked=True,
            split_backward=True,
            exact_chunks=2,
            # no bubble from 2p - 1 micro-batches on; fewer cut the order, leaving about
            # ZB-H1's (p - 1)(F + B - W)
            bubble=lambda p, m, v: 0.0 if m >= 2 * p - 1 else 1 / 3 if m >= p else 1.0,
        ),
        ScheduleKind(
            "chimera",
            vshape.chimera,
            "sync",
            "Chimera: two pipelines in opposite directions, a replica of two stages per rank",
            lambda p, m, v, r: float(min(p, m)),
            replicated=True,
            # Li & Hoefler 2021, Table 2: p - 2 idle slots of 2m + p - 2, 1F1B's 2(p - 1)
            bubble=lambda p, m, v: (p - 2) / (2 * (p - 1)) if m >= p and p > 1 else 1.0,
        ),
        ScheduleKind(
            "pipedream",
            lambda p, m, v: asy.pipedream(p, m),
            "stash",
            "PipeDream: asynchronous 1F1B, an update per micro-batch, weight stashing",
            lambda p, m, v, r: float(p - r),
            per_microbatch=True,
            versions=lambda p, m, s: p - s,
            copies=lambda p, m, s: 0 if s == p - 1 else p - s,
            staleness=_STALE.format("p-1-s updates old"),
        ),
        ScheduleKind(
            "pipedream-vs",
            lambda p, m, v: asy.pipedream_vertical(p, m),
            "vertical",
            "PipeDream with vertical sync: one weight version per micro-batch on every stage",
            lambda p, m, v, r: float(p - r),
            per_microbatch=True,
            versions=lambda p, m, s: p,
            copies=lambda p, m, s: 0 if p == 1 else p if s == 0 else p - 1,
            staleness=_STALE.format("p-1 updates old on every stage"),
        ),
        ScheduleKind(
            "2bw",
            lambda p, m, v: asy.pipedream_2bw(p, m),
            "2bw",
            "PipeDream-2BW: asynchronous 1F1B, an update per batch, two weight buffers",
            lambda p, m, v, r: float(min(p - 1 - r, m) + 1),
            versions=lambda p, m, s: 2,
            copies=lambda p, m, s: 1 if s == p - 1 else 2,
            staleness=_STALE.format("one update old (W(t+1) = W(t) - lr·grad(W(t-1)))"),
        ),
        ScheduleKind(
            "spectrain",
            lambda p, m, v: asy.spectrain(p, m),
            "predict",
            "SpecTrain: asynchronous 1F1B, an update per micro-batch, predicted weights",
            lambda p, m, v, r: float(p - r),
            per_microbatch=True,
            versions=lambda p, m, s: 1 if s == p - 1 else p - s + 1,
            copies=lambda p, m, s: 0 if s == p - 1 else p - s,
            staleness=_STALE.format("predicted p-1-s updates ahead"),
        ),
        ScheduleKind(
            "xpipe",
            lambda p, m, v: asy.xpipe(p, m),
            "predict",
            "XPipe: asynchronous 1F1B, an update per batch, Adam-style predicted weights",
            lambda p, m, v, r: float(p - r),
            versions=lambda p, m, s: 1 if s == p - 1 else 2 + ceil((p - 1 - s) / m),
            copies=lambda p, m, s: 0 if s == p - 1 else 1 + ceil((p - 1 - s) / m),
            staleness=_STALE.format("predicted for the batch's update"),
        ),
    )
}


def kind_names(*, synchronous: bool | None = None, searched: bool | None = None) -> tuple[str, ...]:
    """The kinds' names, in registry order; only the synchronous (or asynchronous) ones
    when `synchronous` is given, only those the planner searches by default (or not)
    when `searched` is."""
    return tuple(
        k.name
        for k in KINDS.values()
        if (synchronous is None or k.synchronous == synchronous)
        and (searched is None or k.searched == searched)
    )


def schedule_kind(name: str) -> ScheduleKind:
    """The registry entry of `name`, or an error listing the kinds."""
    if name not in KINDS:
        raise ValueError(f"schedule kind {name!r} is unknown; choose one of {list(KINDS)}")
    return KINDS[name]


def build(
    kind: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int | None = None,
    *,
    check: bool = True,
    lowered: bool = True,
) -> Schedule:
    """The validated, lowered schedule of `kind`, ready to run or simulate.

    `num_chunks` defaults to the kind's. `check=False` skips the validator (the
    generators are proved by the test suite over every small grid), for callers such as
    the planner that build many large schedules. `lowered=False` stops before the sends
    and receives are inserted: the simulator replays that form to the same times
    (`plait.schedule.replay`), without the actions that only carry messages."""
    entry = schedule_kind(kind)
    chunks = entry.chunks(num_chunks)
    with gc_paused():  # a long pipeline's schedule is hundreds of thousands of actions
        reduced = add_reductions(entry.generate(num_stages, num_microbatches, chunks))
        full = add_communication(reduced) if lowered or check else reduced
    if check:
        validate(full)
    return full if lowered else reduced
