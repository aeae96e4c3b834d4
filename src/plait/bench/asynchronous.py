"""Asynchronous pipelines timed against 1F1B (PipeDream-Flush) on the same model and data.

Each of `--pp` workers builds one engine per schedule (same GPT, same seed, the same
AdamW; each engine on its own process groups, so that one stream's messages in flight
never meet another's) and feeds each the same batches. The schedules take turns in
rounds; a turn runs `--steps` windows back to back, without a barrier between windows,
since an asynchronous stream overlaps them. A turn's time is from a barrier before it to
the last rank's end of its last window; samples per second are windows × batch over that.
1F1B flushes its pipeline every window ((p-1)/(m+p-1) of its time idle); the asynchronous
schedules never flush. Their drains run after the last round, untimed. The peak weight
versions are measured by each rank's weight store (distinct versions alive at once).

Limits: the ceiling of the speed-up is 1 / (1 - bubble) of 1F1B; an update per
micro-batch (pipedream, spectrain) pays m optimizer steps and weight copies per window.
Workers on a CPU share its cores, so ratios, not absolute times, carry over.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common
from plait.flags import deprecated_flag

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncBenchConfig", "AsyncBenchResult", "add_arguments", "run", "run_bench"]


@dataclass(frozen=True, kw_only=True)
class AsyncBenchConfig:
    """Schedules, pipeline shape, model size, rounds and windows per turn."""

    schedules: tuple[str, ...] = ("1f1b", "pipedream", "2bw")
    num_stages: int = 2
    num_microbatches: int = 4
    num_steps: int = 6  # windows per turn
    num_warmup: int = 2  # untimed windows per schedule before the first round
    rounds: int = 3
    num_layers: int = 6
    hidden: int = 256
    num_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    vocab_size: int = 512
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        from plait.config import ParallelPlan

        if "1f1b" not in self.schedules:
            raise ValueError(f"schedules={list(self.schedules)}: include 1f1b, the baseline")
        from plait.models import GPTConfig

        for name in ("num_stages", "num_microbatches", "num_steps", "rounds", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup={self.num_warmup} must be >= 0")
        GPTConfig(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            hidden=self.hidden,
            num_heads=self.num_heads,
        )  # validates the model size
        if self.batch_size % self.num_microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by num_microbatches="
                f"{self.num_microbatches}: use a multiple"
            )
        if self.num_layers + 2 < self.num_stages:
            raise ValueError(
                f"num_layers={self.num_layers}: {self.num_stages} stages need at least "
                f"{self.num_stages - 2} layers"
            )
        for kind in self.schedules:  # names a schedule plait knows and that it can run
            ParallelPlan(pp=self.num_stages, schedule=kind, microbatches=self.num_microbatches)


@dataclass(frozen=True)
class AsyncBenchResult:
    """Per schedule: the turns' seconds, and each rank's peak weight versions."""

    config: AsyncBenchConfig
    turn_s: dict[str, list[float]]
    peak_weight_versions: dict[str, list[int]]

    def samples_per_s(self, kind: str) -> float:
        c = self.config
        return c.num_steps * c.batch_size / common.median(self.turn_s[kind])

    def to_dict(self) -> dict[str, Any]:
        base = self.samples_per_s("1f1b")
        return {
            "stages": self.config.num_stages,
            "microbatches": self.config.num_microbatches,
            "config": asdict(self.config),
            "schedules": {
                kind: {
                    "samples_per_s": self.samples_per_s(kind),
                    "speedup_vs_1f1b": self.samples_per_s(kind) / base,
                    "peak_weight_versions": self.peak_weight_versions[kind],
                    "turn_s": self.turn_s[kind],
                }
                for kind in self.config.schedules
            },
        }


def run_bench(config: AsyncBenchConfig) -> AsyncBenchResult:
    """Launch `config.num_stages` workers, time every schedule in them, and summarize."""
    from plait.train import launch

    per_rank = launch(_worker, config.num_stages, config)
    reports = [per_rank[r] for r in sorted(per_rank)]
    turns, versions = {}, {}
    for kind in config.schedules:
        starts = zip(*(r["starts"][kind] for r in reports), strict=True)
        ends = zip(*(r["ends"][kind] for r in reports), strict=True)
        turns[kind] = [max(e) - min(s) for s, e in zip(starts, ends, strict=True)]
        versions[kind] = [r["versions"][kind] for r in reports]
    return AsyncBenchResult(config, turns, versions)


# ------------------------------------------------------------------ in the workers
def _worker(config: AsyncBenchConfig) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    _env, device = init_worker(timeout_s=300.0)
    try:
        return _measure(config, device)
    finally:
        dist.destroy_process_group()


def _engine(config: AsyncBenchConfig, kind: str, device: torch.device) -> Any:
    import torch

    from plait.config import ParallelPlan
    from plait.models import GPT, GPTConfig
    from plait.train.parallelize import parallelize

    plan = ParallelPlan(pp=config.num_stages, schedule=kind, microbatches=config.num_microbatches)
    torch.manual_seed(config.seed)
    model = GPT(
        GPTConfig(vocab_size=config.vocab_size, seq_len=config.seq_len, hidden=config.hidden,
                  num_layers=config.num_layers, num_heads=config.num_heads)
    )  # fmt: skip
    return parallelize(
        model,
        plan,
        lambda ps: torch.optim.AdamW(ps, lr=config.lr),
        GPT.loss,
        mesh=_private_mesh(config.num_stages, device.type),
        device=device,
    )


def _private_mesh(world: int, device_type: str) -> Any:
    """A (pp, dp, tp) = (world, 1, 1) mesh on process groups of its own: an asynchronous
    stream leaves messages in flight between windows, which must not meet another
    engine's (a mesh over the whole world would reuse the default group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    pipeline = dist.new_group(list(range(world)))
    alone = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mine = alone[dist.get_rank()]
    grid = torch.arange(world).reshape(world, 1, 1)
    return DeviceMesh.from_group(
        [pipeline, mine, mine], device_type, grid, mesh_dim_names=("pp", "dp", "tp")
    )


def _measure(config: AsyncBenchConfig, device: torch.device) -> dict[str, Any]:
    """Rounds of turns; this rank's start and end time of every turn, per schedule."""
    import torch.distributed as dist

    engines = {kind: _engine(config, kind, device) for kind in config.schedules}
    window = {kind: 0 for kind in config.schedules}

    def run(kind: str, count: int) -> None:
        for _ in range(count):
            engines[kind].step(common.token_batch(config, window[kind], device))
            window[kind] += 1

    for kind in config.schedules:
        run(kind, config.num_warmup)
    starts: dict[str, list[float]] = {k: [] for k in config.schedules}
    ends: dict[str, list[float]] = {k: [] for k in config.schedules}
    for _ in range(config.rounds):
        for kind in config.schedules:
            dist.barrier()
            starts[kind].append(time.perf_counter())
            run(kind, config.num_steps)
            ends[kind].append(time.perf_counter())
    versions = {}
    for kind, engine in engines.items():
        engine.drain()
        versions[kind] = sum(engine.executor.weights.peak_versions.values())
    return {"starts": starts, "ends": ends, "versions": versions}


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AsyncBenchConfig()
    a = parser.add_argument
    a("--schedules", default=",".join(d.schedules), help="comma-separated kinds (with 1f1b)")
    a("--pp", type=int, default=d.num_stages, dest="stages", help="pipeline ranks (local workers)")
    deprecated_flag(parser, "--stages", "--pp", "stages", type=int)
    a("--microbatches", type=int, default=d.num_microbatches, help="micro-batches per window")
    a("--steps", type=int, default=d.num_steps, help="timed windows per turn")
    a("--warmup", type=int, default=d.num_warmup, help="untimed windows of each schedule first")
    a("--rounds", type=int, default=d.rounds, help="turns of every schedule (median of them)")
    a("--layers", type=int, default=d.num_layers, help="GPT transformer layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--heads", type=int, default=d.num_heads, help="attention heads")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per window")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    config = AsyncBenchConfig(
        schedules=tuple(k for k in args.schedules.split(",") if k),
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        num_steps=args.steps,
        num_warmup=args.warmup,
        rounds=args.rounds,
        num_layers=args.layers,
        hidden=args.hidden,
        num_heads=args.heads,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    result = run_bench(config).to_dict()
    if args.json:
        common.print_json(result)
        return 0
    rows = [
        [
            kind,
            f"{r['samples_per_s']:.1f}",
            f"{r['speedup_vs_1f1b']:.2f}×",
            " ".join(map(str, r["peak_weight_versions"])),
        ]
        for kind, r in result["schedules"].items()
    ]
    common.print_table(
        f"asynchronous pipelines, {config.num_stages} stages × {config.num_microbatches} "
        "micro-batches",
        ["schedule", "samples/s", "vs 1F1B", "peak weight versions per rank"],
        rows,
    )
    return 0
