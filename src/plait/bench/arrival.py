"""How long one all-to-all takes on this host, by how the workers arrive at it.

The cost model prices a collective by the alpha-beta model alone: its time is the link's
latency and bandwidth, whatever the workers did before. On a host whose workers share
cores, or whose cores are virtual, that is not always so, and `plait bench moe`'s
all-to-all share is only as predictable as this bench finds the host. `W` workers (gloo on
CPU, NCCL on GPUs, pinned as `plait.mesh.init_worker` pins them) time the same
all-to-all of each of `--sizes` KiB per rank under five arrival patterns, taking turns
call by call so that machine drift hits all alike; each call starts after a tiny
all-to-all that lines the ranks up, and is charged the least time any rank spent in it
(what is left when no rank waits for a later one):

- `back-to-back`: the exchange right after the line-up (how link probes time a link);
- `together`: every rank computes for `--compute-ms` first, from the same instant, so
  all arrive within microseconds, as ranks do at a collective that follows equal work;
- `idle-together`: every rank sleeps `--compute-ms` instead: whether it is the compute
  or the waking that costs;
- `jittered`: every rank computes `--compute-ms` plus a uniform draw in `[0, --jitter-ms]`
  of its own, as ranks with slightly unequal work arrive;
- `one-late`: the last rank computes `--late-ms` while the others wait in the exchange.

Per pattern and size: the median, mean, 90th percentile and largest seconds, and
`slow_fraction`, the share of calls that took more than `SLOW_FACTOR` times the
back-to-back median of that size. Where the alpha-beta model holds, every pattern's
median and mean sit near the back-to-back median; `samples_s` holds every call's seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common

if TYPE_CHECKING:
    import torch

__all__ = ["PATTERNS", "SLOW_FACTOR", "ArrivalConfig", "add_arguments", "run", "run_bench",
           "summarise"]  # fmt: skip

PATTERNS = ("back-to-back", "together", "idle-together", "jittered", "one-late")
SLOW_FACTOR = 4.0


@dataclass(frozen=True, kw_only=True)
class ArrivalConfig:
    workers: int = 2
    sizes_kib: tuple[int, ...] = (8, 512)  # per rank: a counts-like and a dispatch-like call
    compute_ms: float = 5.0
    jitter_ms: float = 1.0
    late_ms: float = 3.0
    num_calls: int = 100
    num_warmup: int = 5

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError(f"workers={self.workers}: an all-to-all needs 2 or more workers")
        if not self.sizes_kib or min(self.sizes_kib) < 1:
            raise ValueError(f"sizes={self.sizes_kib}: give sizes of 1 KiB or more")
        for name in ("compute_ms", "jitter_ms", "late_ms"):
            value = getattr(self, name)
            if not 0 <= value < 10_000:  # also refuses nan
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {value}: give milliseconds >= 0 and below 10000")
        if self.num_calls < 1 or self.num_warmup < 0:
            raise ValueError(
                f"calls={self.num_calls} must be >= 1 and warmup={self.num_warmup} >= 0"
            )


def run_bench(config: ArrivalConfig) -> dict[str, Any]:
    from plait.train import launch

    per_rank = launch(_worker, config.workers, config)
    return {
        "config": asdict(config),
        "slow_factor": SLOW_FACTOR,
        "patterns": summarise([per_rank[r] for r in sorted(per_rank)], config),
    }


def summarise(per_rank: list[dict[str, Any]], config: ArrivalConfig) -> dict[str, Any]:
    """{pattern: {size KiB: statistics}} from each rank's {pattern: {size: [seconds]}}:
    each call charged the least time over the ranks, the warm-up calls left out."""
    least = {
        p: {
            str(kib): [min(c) for c in zip(*(r[p][str(kib)] for r in per_rank), strict=True)][
                config.num_warmup :
            ]
            for kib in config.sizes_kib
        }
        for p in PATTERNS
    }
    out: dict[str, Any] = {}
    for pattern, sizes in least.items():
        out[pattern] = {}
        for kib, seconds in sizes.items():
            base = statistics.median(least["back-to-back"][kib])
            ordered = sorted(seconds)
            out[pattern][kib] = {
                "median_s": statistics.median(seconds),
                "mean_s": statistics.fmean(seconds),
                "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                "max_s": ordered[-1],
                "slow_fraction": sum(s > SLOW_FACTOR * base for s in seconds) / len(seconds),
                "samples_s": seconds,
            }
    return out


# ------------------------------------------------------------------ in the workers
def _worker(config: ArrivalConfig) -> dict[str, dict[str, list[float]]]:
    common.single_thread()
    import torch
    import torch.distributed as dist

    from plait.mesh import init_worker

    env, device = init_worker(timeout_s=300.0)
    try:
        rng = random.Random(env.rank)  # each rank its own jitter
        work = torch.randn(128, 128, device=device)
        line_up = torch.zeros(env.world_size, device=device)
        times: dict[str, dict[str, list[float]]] = {
            p: {str(k): [] for k in config.sizes_kib} for p in PATTERNS
        }
        buffers = {k: torch.zeros(k * 256, device=device) for k in config.sizes_kib}
        for i in range(config.num_warmup + config.num_calls):
            shift = i % len(PATTERNS)
            for pattern in PATTERNS[shift:] + PATTERNS[:shift]:
                for kib, buf in buffers.items():
                    delay = _delay(pattern, config, env.rank, env.world_size, rng)
                    dist.all_to_all_single(torch.empty_like(line_up), line_up)
                    _spend(delay, pattern == "idle-together", work, device)
                    out = torch.empty_like(buf)
                    t0 = common.now(device)
                    dist.all_to_all_single(out, buf)
                    times[pattern][str(kib)].append(common.now(device) - t0)
        return times
    finally:
        dist.destroy_process_group()


def _delay(pattern: str, c: ArrivalConfig, rank: int, world: int, rng: random.Random) -> float:
    """Seconds this rank spends before the exchange under `pattern`."""
    if pattern in ("together", "idle-together"):
        return c.compute_ms / 1e3
    if pattern == "jittered":
        return (c.compute_ms + rng.uniform(0.0, c.jitter_ms)) / 1e3
    if pattern == "one-late":
        return c.late_ms / 1e3 if rank == world - 1 else 0.0
    return 0.0


def _spend(seconds: float, idle: bool, work: torch.Tensor, device: torch.device) -> None:
    if idle:
        time.sleep(seconds)
    else:
        common.busy(seconds, work, device)


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ArrivalConfig()
    a = parser.add_argument
    a("--workers", type=int, default=d.workers, help="workers (2 or more)")
    a("--sizes", default=",".join(map(str, d.sizes_kib)),
      help="all-to-all sizes, KiB per rank, comma-separated")  # fmt: skip
    a("--compute-ms", type=float, default=d.compute_ms, help="compute before the exchange")
    a("--jitter-ms", type=float, default=d.jitter_ms, help="jittered: extra compute, up to")
    a("--late-ms", type=float, default=d.late_ms, help="one-late: the last rank's compute")
    a("--calls", type=int, default=d.num_calls, help="timed calls per pattern and size")
    a("--warmup", type=int, default=d.num_warmup, help="first calls left out")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s)
    except ValueError:
        raise ValueError(f"--sizes {args.sizes!r}: give whole KiB, comma-separated") from None
    config = ArrivalConfig(workers=args.workers, sizes_kib=sizes, compute_ms=args.compute_ms,
                           jitter_ms=args.jitter_ms, late_ms=args.late_ms,
                           num_calls=args.calls, num_warmup=args.warmup)  # fmt: skip
    result = run_bench(config)
    if args.json:
        common.print_json(result)
        return 0
    rows = [
        [p, kib, *(f"{s[k] * 1e3:.2f}" for k in ("median_s", "mean_s", "p90_s", "max_s")),
         f"{s['slow_fraction']:.2f}"]
        for p, sizes in result["patterns"].items() for kib, s in sizes.items()
    ]  # fmt: skip
    common.print_table(
        f"all-to-all over {config.workers} workers by arrival, {config.num_calls} calls each",
        [
            "arrival",
            "KiB/rank",
            "median ms",
            "mean ms",
            "p90 ms",
            "max ms",
            f"> {SLOW_FACTOR:g}× back-to-back",
        ],
        rows,
    )
    return 0
