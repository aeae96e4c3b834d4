"""Choosing WSP's staleness bound D within the user's allowance, and saying what it buys.

With an allowance, WSP competes inside the planner's search (`wsp_variants`): every
ranked plan the runtime can train under WSP gets its own D and is ranked again at the
replayed pace, so a layout whose gradient reduction WSP hides can beat the synchronous
best (and the synchronous plan is kept where WSP gains nothing).

A larger D lets the wave exchange overlap more computation (`plait.sim.wsp`), but each
virtual worker then computes on the others' updates D waves late, which costs updates to
reach a loss (HetPipe, Park et al., ATC 2020; Ho et al., NIPS 2013 for SSP). The planner
takes the smallest D within the allowance whose replayed pace is within `tolerance` of
the fastest D in it: beyond it, staleness is paid for nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from plait.cluster import Cluster
from plait.cost import BlockCost
from plait.cost.comm import all_reduce_time
from plait.plan.exact import RankedPlan
from plait.plan.space import ModelSpec
from plait.sim.wsp import replay_wsp, wave_step_s, wsp_memory_bytes

__all__ = [
    "StalenessChoice",
    "choose_staleness",
    "staleness_for",
    "wave_exchange",
    "wave_time",
    "wsp_variants",
]


@dataclass(frozen=True)
class StalenessChoice:
    staleness: int
    seconds_per_wave: tuple[float, ...]  # replayed pace for D = 0..allowance
    extra_bytes: tuple[float, ...]  # WSP's memory per rank for each D
    explanation: str


def choose_staleness(
    wave_s: Sequence[float],
    *,
    exchange_s: float,
    allowance: int,
    weight_bytes: float = 0.0,
    tolerance: float = 0.01,
    waves: int = 32,
) -> StalenessChoice:
    """The D in 0..`allowance` for workers of wave times `wave_s` and an exchange of
    `exchange_s` seconds (see the module docstring), with the reason in words."""
    if allowance < 0:
        raise ValueError(f"allowance={allowance}: give the most waves of staleness, >= 0")
    paces = tuple(
        replay_wsp(wave_s, staleness=d, waves=waves, exchange_s=exchange_s).seconds_per_wave
        for d in range(allowance + 1)
    )
    best = min(paces)
    chosen = next(d for d, p in enumerate(paces) if p <= best * (1 + tolerance))
    memory = tuple(wsp_memory_bytes(weight_bytes, d) for d in range(allowance + 1))
    lines = [
        f"D={d}: {p * 1e3:.2f} ms per wave ({paces[0] / p:.2f}× D=0's waves/s), "
        f"+{memory[d] / 2**20:.1f} MiB per rank" + (" <- chosen" if d == chosen else "")
        for d, p in enumerate(paces)
    ]
    slowest = max(wave_s)
    if chosen == 0:
        why = (
            f"D=0: the exchange ({exchange_s * 1e3:.2f} ms) is not worth hiding behind "
            "stale weights"
            if allowance
            else "D=0: no staleness allowed, every wave waits for the exchange"
        )
    else:
        why = (
            f"D={chosen} hides the {exchange_s * 1e3:.2f} ms exchange behind the next "
            f"waves; more staleness would not go faster (every worker keeps the slowest "
            f"one's pace, {slowest * 1e3:.2f} ms a wave) and would cost updates to converge"
        )
    return StalenessChoice(chosen, paces, memory, "\n".join([why, *lines]))


def wave_exchange(
    blocks: Sequence[BlockCost],
    cuts: Sequence[Sequence[int]],
    cluster: Cluster,
    workers: int,
    num_devices: int,
) -> tuple[float, float]:
    """(bytes, seconds) of a wave's exchange among `workers` pipelines cut as `cuts`: an
    all-reduce of the largest stage's fp32 weights on the slowest link from rank 0."""
    weight_bytes = 4.0 * _largest_stage(blocks, cuts)
    link = max((cluster.link(0, r) for r in range(1, num_devices)),
               key=lambda k: k.time(weight_bytes), default=cluster.link(0, 0))  # fmt: skip
    return weight_bytes, all_reduce_time(workers, weight_bytes, link)


def staleness_for(
    ranked: RankedPlan, model: ModelSpec, cluster: Cluster, allowance: int
) -> StalenessChoice:
    """`choose_staleness` for a searched plan: each pipeline's wave is one step of its
    simulated pipeline (`wave_time`), and the exchange is an all-reduce over the replicas
    of the largest rank's weights (fp32) on the slowest link between them."""
    plan = ranked.plan
    if ranked.hetero is not None:
        wave_s = [wave_step_s(r.run) for r in ranked.hetero.replicas]
        cuts = [r.sizes for r in ranked.hetero.replicas]
    else:
        wave_s, cuts = [wave_time(ranked)] * plan.dp, [ranked.sizes] * plan.dp
    weight_bytes, exchange_s = wave_exchange(
        model.blocks_for(plan), cuts, cluster, plan.dp, plan.world_size
    )
    return choose_staleness(wave_s, exchange_s=exchange_s, allowance=allowance,
                            weight_bytes=weight_bytes)  # fmt: skip


def wave_time(ranked: RankedPlan) -> float:
    """Seconds of one step of a replica under WSP (`plait.sim.wsp.wave_step_s`); without
    a replay, the whole step."""
    return ranked.step_time_s if ranked.result is None else wave_step_s(ranked.result)


def wsp_variants(
    ranked: Sequence[RankedPlan],
    model: ModelSpec,
    cluster: Cluster,
    allowance: int,
    margin: float = 0.05,
) -> list[RankedPlan]:
    """Each plan of `ranked` that the runtime can train under WSP (two replicas or more,
    whole unsharded pipelines: the plan's own checks decide), with D chosen within
    `allowance` (`staleness_for`) and its step the replayed pace (`wsp_step_s`). D stays
    within what leaves `margin` of every rank's memory free beside WSP's own copies
    (`wsp_memory_bytes`, counted for the largest stage's weights on every rank)."""
    out = []
    for r in ranked:
        plan = r.plan
        if plan.dp < 2 or plan.wsp_staleness is not None or r.wsp_step_s:
            continue
        try:  # what training would refuse (the plan's checks, which a SimPlan skips)
            dataclasses.replace(plan.parallel_plan(), wsp_staleness=0)
        except ValueError:
            continue
        fits = _fitting_staleness(r, model, allowance, margin)
        if fits is None:
            continue
        choice = staleness_for(r, model, cluster, fits)
        pace = choice.seconds_per_wave[choice.staleness] / plan.wsp_wave
        simulated = r.simulated_step_s
        device_mfu = r.mfu * r.step_time_s / simulated  # over the simulator's step
        device_tokens = r.tokens_per_s * r.step_time_s / simulated
        peak = tuple(m + wsp_memory_bytes(_weight_bytes(r, model), choice.staleness)
                     for m in r.peak_memory_bytes)  # fmt: skip
        out.append(dataclasses.replace(
            r, plan=dataclasses.replace(plan, wsp_staleness=choice.staleness),
            step_time_s=pace, wsp_step_s=pace, mfu=device_mfu * simulated / pace,
            tokens_per_s=device_tokens * simulated / pace, loader_step_s=0.0,
            peak_memory_bytes=peak,
        ))  # fmt: skip
    return out


def _weight_bytes(ranked: RankedPlan, model: ModelSpec) -> float:
    """fp32 bytes of the largest stage's weights (any pipeline), times the stages a rank
    holds: what WSP copies on a rank, at the most."""
    cuts = ([r.sizes for r in ranked.hetero.replicas] if ranked.hetero is not None
            else [ranked.sizes])  # fmt: skip
    return 4.0 * _largest_stage(model.blocks_for(ranked.plan), cuts) * ranked.plan.chunks


def _fitting_staleness(
    ranked: RankedPlan, model: ModelSpec, allowance: int, margin: float
) -> int | None:
    """The largest D within `allowance` whose WSP copies fit beside every rank's peak."""
    weight = _weight_bytes(ranked, model)
    pairs = list(zip(ranked.peak_memory_bytes, ranked.capacity_bytes, strict=True))
    fitting = [
        d for d in range(allowance + 1)
        if all(m + wsp_memory_bytes(weight, d) <= (1 - margin) * c for m, c in pairs)
    ]  # fmt: skip
    return max(fitting) if fitting else None


def _largest_stage(blocks: Sequence[BlockCost], cuts: Sequence[Sequence[int]]) -> int:
    """The most parameters a stage holds, over the pipelines cut as `cuts`."""
    largest = 0
    for sizes in cuts:
        first = 0
        for n in sizes:
            largest = max(largest, sum(b.num_params for b in blocks[first : first + n]))
            first += n
    return largest
