"""`plait simulate --wsp-staleness D [--wsp-wave N]`: a WSP layout's virtual workers.

Each virtual worker (one pipeline: a data-parallel replica, or one of a plan file's
`pipelines` with its own cut and share of the batch) is simulated alone for one step
(`plait.sim.replica`, its pipelined compute: WSP replaces the per-step gradient reduction
by the wave exchange). Its wave is N such steps; the waves of all workers are replayed
under D (`plait.sim.wsp.replay_wsp`) with the exchange the planner charges (an all-reduce
of the largest stage's fp32 weights over the workers, `plait.plan.wsp.wave_exchange`).
Per worker: its step alone, its steady pace in the replay (every worker keeps the
slowest one's pace in the long run, D hides the exchange), the share of the replay it
waits, and its peak memory per rank: the simulated step's plus what WSP keeps
(`plait.sim.wsp.wsp_memory_bytes`: the wave's snapshot, and D + 1 updates and buffers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from plait.cluster import Cluster
from plait.cost import BlockCost, StageCost
from plait.plan.wsp import wave_exchange
from plait.sim import SimPlan, build_schedule
from plait.sim.replica import simulate_replica
from plait.sim.wsp import replay_wsp, wave_step_s, wsp_memory_bytes

__all__ = ["check_wsp", "print_wsp", "wsp_summary"]

WAVES = 32  # replayed waves: enough for the pace of any D up to 15 (two cycles)


def check_wsp(plan: SimPlan, staleness: int, wave: int, pipelines: Any) -> None:
    """Raise ValueError for a WSP layout training would refuse (its own messages)."""
    if staleness < 0 or wave < 1:
        raise ValueError(
            f"--wsp-staleness {staleness} --wsp-wave {wave}: need D >= 0 waves and a wave "
            "of >= 1 steps"
        )
    given = pipelines if pipelines is not None else plan.pipelines
    dataclasses.replace(plan.parallel_plan(), wsp_staleness=staleness, wsp_wave=wave,
                        pipelines=given)  # fmt: skip


def wsp_summary(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    plan: SimPlan,
    sizes: Sequence[int],
    *,
    staleness: int,
    wave: int,
    pipelines: Any = None,
) -> dict[str, Any]:
    """The JSON `wsp` object: the virtual workers of `plan` (cut as `sizes`, or as each of
    `pipelines`), replayed under D = `staleness` with waves of `wave` steps."""
    check_wsp(plan, staleness, wave, pipelines)
    layout = dataclasses.replace(plan.parallel_plan(), pipelines=pipelines)
    if layout.pipelines is not None:
        cuts = [tuple(p.partition) for p in layout.pipelines]
        counts = [p.microbatches for p in layout.pipelines]
    else:
        cuts, counts = [tuple(sizes)] * plan.dp, [plan.microbatches] * plan.dp
    workers: list[dict[str, Any]] = []
    wave_s: list[float] = []
    for d, (cut, m) in enumerate(zip(cuts, counts, strict=True)):
        mine = dataclasses.replace(plan, microbatches=m)
        schedule = build_schedule(mine, check=False, lowered=False)
        firsts = [sum(cut[:s]) for s in range(len(cut))]
        stage_blocks = [list(blocks[f : f + n]) for f, n in zip(firsts, cut, strict=True)]
        run = simulate_replica(schedule, [StageCost(tuple(b)) for b in stage_blocks],
                               cluster, mine, d)  # fmt: skip
        params = [0] * plan.pp
        for s, rank in enumerate(schedule.stage_to_rank):
            params[rank] += sum(b.num_params for b in stage_blocks[s])
        extra = [wsp_memory_bytes(4.0 * p, staleness) for p in params]
        memory = [r.memory.total + x for r, x in zip(run.ranks, extra, strict=True)]
        alone = wave_step_s(run)
        wave_s.append(alone * wave)
        workers.append({
            "pipeline": d, "partition": list(cut), "microbatches": m,
            "devices": [r.device for r in run.ranks],
            "alone_step_time_s": alone,
            "wsp_extra_bytes": extra, "peak_memory_bytes": memory,
            "fits": all(x <= r.capacity_bytes for x, r in zip(memory, run.ranks, strict=True)),
        })  # fmt: skip
    return _waves(blocks, cluster, plan, cuts, wave_s, workers, staleness=staleness, wave=wave)


def wsp_of_depths(
    blocks: Sequence[BlockCost], cluster: Cluster, plan: SimPlan, replicas: Sequence[Any],
    *, staleness: int, wave: int,
) -> dict[str, Any]:  # fmt: skip
    """`wsp_summary` for pipelines of different depths, each already replayed at its own
    depth (`plait.plan.depths.simulate_pipelines`' replicas)."""
    check_wsp(plan, staleness, wave, None)
    workers: list[dict[str, Any]] = []
    wave_s: list[float] = []
    for r in replicas:
        params = [sum(b.num_params for b in blocks[sum(r.sizes[:s]) : sum(r.sizes[: s + 1])])
                  for s in range(len(r.sizes))]  # fmt: skip
        extra = [wsp_memory_bytes(4.0 * p, staleness) for p in params]
        memory = [x.memory.total + e for x, e in zip(r.run.ranks, extra, strict=True)]
        alone = wave_step_s(r.run)
        wave_s.append(alone * wave)
        workers.append({
            "pipeline": r.dp_rank, "partition": list(r.sizes),
            "microbatches": r.num_microbatches, "devices": list(r.devices),
            "alone_step_time_s": alone, "wsp_extra_bytes": extra, "peak_memory_bytes": memory,
            "fits": all(m <= x.capacity_bytes for m, x in zip(memory, r.run.ranks, strict=True)),
        })  # fmt: skip
    cuts = [tuple(r.sizes) for r in replicas]
    return _waves(blocks, cluster, plan, cuts, wave_s, workers, staleness=staleness, wave=wave)


def _waves(
    blocks: Sequence[BlockCost], cluster: Cluster, plan: SimPlan, cuts: Sequence[Sequence[int]],
    wave_s: list[float], workers: list[dict[str, Any]], *, staleness: int, wave: int,
) -> dict[str, Any]:  # fmt: skip
    """The waves of workers taking `wave_s` each, replayed under D = `staleness`."""
    _, exchange_s = wave_exchange(blocks, cuts, cluster, len(cuts), plan.world_size)
    replay = replay_wsp(wave_s, staleness=staleness, waves=WAVES, exchange_s=exchange_s)
    cycle = staleness + 1
    span = cycle * (WAVES // 2 // cycle)
    for i, w in enumerate(workers):
        ends = replay.ends[i]
        w["step_time_s"] = (ends[-1] - ends[-1 - span]) / span / wave
        w["waiting_share"] = replay.waiting_s(i) / ends[-1]
    return {
        "wsp_staleness": staleness, "wsp_wave": wave, "exchange_s": exchange_s,
        "step_time_s": replay.seconds_per_wave / wave, "virtual_workers": workers,
    }  # fmt: skip


def print_wsp(wsp: dict[str, Any]) -> None:
    print(
        f"\nWSP, D={wsp['wsp_staleness']}, waves of {wsp['wsp_wave']} step(s), exchange "
        f"{wsp['exchange_s'] * 1e3:.2f} ms: {wsp['step_time_s'] * 1e3:.2f} ms a step"
    )
    for w in wsp["virtual_workers"]:
        print(
            f"  worker {w['pipeline']} ({', '.join(w['devices'])}; {w['microbatches']} "
            f"micro-batches): {w['alone_step_time_s'] * 1e3:.2f} ms a step alone, "
            f"{w['step_time_s'] * 1e3:.2f} ms in the waves, waits "
            f"{w['waiting_share']:.0%}, peak {max(w['peak_memory_bytes']) / 2**30:.2f} GiB"
        )
