"""Dynamic re-partitioning against a worker slowed mid-run: steps/s before, slowed, moved.

Two pipeline workers (1F1B, a small GPT, SGD) start on an equal split. Every block's
compute is emulated: hooks sleep `--block-ms` after its forward and twice that when its
backward starts (a backward costs two forwards, Narayanan et al. 2021), on top of its
real compute, kept tiny; so the times do not depend on how many of a shared machine's
cores are free, and the pipeline's overlap is real. From step `--slow-from` the last
worker sleeps `--slowdown` × as long (2: half speed).
Three measurements, each a run of `--steps` steps timed between barriers over windows of
`--window` steps:

- `off`: no re-partitioning; steps/s before the slowdown and after it;
- `auto`: `plait.train.repartition` watching the stage times (`--threshold`,
  `--patience`); steps/s over the last window, after its moves;
- `planned`: every contiguous split of the blocks, each timed with the worker slowed
  from the start; the fastest is what a planner knowing the slowdown would pick.

`recovered_fraction` = steps/s of `auto` after its move / steps/s of the best `planned`
split (target ≥ 0.8). Limits: workers on a CPU share its cores and the machine may be
shared, so ratios, not absolute times, carry over; the slowdown's backward share is an
estimate.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common

if TYPE_CHECKING:
    import torch

    from plait.emulate.slowdown import EmulatedCompute

__all__ = ["RepartitionBenchConfig", "add_arguments", "run", "run_bench"]


@dataclass(frozen=True, kw_only=True)
class RepartitionBenchConfig:
    """Model, batch, the emulated and the policy."""

    num_steps: int = 30
    slow_from: int = 10
    window: int = 5  # steps per timed window
    slowdown: float = 2.0
    block_ms: float = 5.0  # emulated compute of a block's forward (its backward: twice)
    threshold: float = 0.2
    patience: int = 2
    num_layers: int = 6
    hidden: int = 32
    num_heads: int = 4
    seq_len: int = 16
    batch_size: int = 8
    num_microbatches: int = 4
    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        from plait.models import GPTConfig

        for name in ("num_steps", "window", "patience", "num_layers", "batch_size",
                     "num_microbatches"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 1 <= self.slow_from < self.num_steps - self.window:
            raise ValueError(
                f"slow_from={self.slow_from} must lie in [1, num_steps - window = "
                f"{self.num_steps - self.window}): a window must run before and after it"
            )
        if not self.block_ms > 0:
            raise ValueError(f"block_ms={self.block_ms} must be positive (milliseconds)")
        if not self.slowdown >= 1:
            raise ValueError(f"slowdown={self.slowdown} must be >= 1 (2: half speed)")
        if not self.threshold > 0:
            raise ValueError(f"threshold={self.threshold} must be positive")
        if self.batch_size % self.num_microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by num_microbatches="
                f"{self.num_microbatches}: use a multiple"
            )
        GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, num_layers=self.num_layers,
                  hidden=self.hidden, num_heads=self.num_heads)  # fmt: skip


def run_bench(config: RepartitionBenchConfig) -> dict[str, Any]:
    """Launch 2 workers, measure, and summarize as one JSON-ready dict."""
    from plait.train import launch

    found = launch(_worker, 2, config)[0]
    planned = max(found["planned"].values())
    best = max(found["planned"], key=lambda k: found["planned"][k])
    return {
        "config": asdict(config),
        "steps_per_s_before": found["before"],
        "steps_per_s_slowed_off": found["slowed_off"],
        "steps_per_s_slowed_auto": found["slowed_auto"],
        "steps_per_s_planned": planned,
        "planned_partition": [int(n) for n in best.split(",")],
        "planned_by_partition": found["planned"],
        "moves": found["moves"],
        "recovered_fraction": found["slowed_auto"] / planned,
    }


# ------------------------------------------------------------------ in the workers
def _worker(config: RepartitionBenchConfig) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    _env, device = init_worker(timeout_s=300.0)
    try:
        return _measure(config, device)
    finally:
        dist.destroy_process_group()


def _setup(
    config: RepartitionBenchConfig, device: torch.device
) -> tuple[Any, Any, EmulatedCompute]:
    """The model (same seed everywhere), `build(plan) -> Engine`, and this worker's hook."""
    import torch
    import torch.distributed as dist

    from plait.config import ParallelPlan
    from plait.emulate.slowdown import EmulatedCompute
    from plait.models import GPT, GPTConfig
    from plait.train.engine import Engine
    from plait.train.parallelize import parallelize

    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=config.vocab_size, seq_len=config.seq_len,
                          num_layers=config.num_layers, hidden=config.hidden,
                          num_heads=config.num_heads))  # fmt: skip

    def build(plan: ParallelPlan) -> Engine:
        return parallelize(model, plan, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
                           GPT.loss, device=device)  # fmt: skip

    slowdown = config.slowdown if dist.get_rank() == 1 else 1.0
    return model, build, EmulatedCompute(model, config.block_ms / 1000, slowdown)


def _plan(config: RepartitionBenchConfig, sizes: tuple[int, ...] | None = None) -> Any:
    from plait.config import ParallelPlan

    return ParallelPlan(pp=2, microbatches=config.num_microbatches, partition=sizes)


def _timed(engine: Any, steps: range, config: RepartitionBenchConfig, device: Any) -> float:
    """Steps/s of `steps` between barriers."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for step in steps:
        engine.step(common.token_batch(config, step, device))
    dist.barrier()
    return len(steps) / (time.perf_counter() - t0)


def _measure(config: RepartitionBenchConfig, device: torch.device) -> dict[str, Any]:
    from plait.train.repartition import Repartitioner

    c, w = config, config.window
    # off: one window before the slowdown, the last window after it
    _, build, emulated = _setup(c, device)
    engine = build(_plan(c))
    for step in range(c.slow_from - w):
        engine.step(common.token_batch(c, step, device))
    before = _timed(engine, range(c.slow_from - w, c.slow_from), c, device)
    emulated.slow = True
    for step in range(c.slow_from, c.num_steps - w):
        engine.step(common.token_batch(c, step, device))
    slowed_off = _timed(engine, range(c.num_steps - w, c.num_steps), c, device)
    # auto: the same run with the policy stepping in
    model, build, emulated = _setup(c, device)
    engine = build(_plan(c))
    mover = Repartitioner(model, build, threshold=c.threshold, patience=c.patience)
    for step in range(c.num_steps - w):
        emulated.slow = step >= c.slow_from
        report = engine.step(common.token_batch(c, step, device))
        engine = mover.after_step(engine, report, step)
    slowed_auto = _timed(engine, range(c.num_steps - w, c.num_steps), c, device)
    # planned: every split, slowed from the start (one untimed step each)
    planned = {}
    blocks = c.num_layers + 2
    for first in range(1, blocks):
        sizes = (first, blocks - first)
        _, build, emulated = _setup(c, device)
        emulated.slow = True
        engine = build(_plan(c, sizes))
        engine.step(common.token_batch(c, 0, device))
        planned[f"{first},{blocks - first}"] = _timed(engine, range(1, w + 1), c, device)
    return {
        "before": before,
        "slowed_off": slowed_off,
        "slowed_auto": slowed_auto,
        "planned": planned,
        "moves": [[step, list(sizes)] for step, sizes in mover.moves],
    }


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RepartitionBenchConfig()
    a = parser.add_argument
    a("--steps", type=int, default=d.num_steps, help="steps of each run")
    a("--slow-from", type=int, default=d.slow_from, help="the step the worker slows down at")
    a("--window", type=int, default=d.window, help="steps per timed window")
    a("--slowdown", type=float, default=d.slowdown, help="the slowed worker's time factor")
    a("--block-ms", type=float, default=d.block_ms,
      help="emulated milliseconds of a block's forward (backward: twice)")  # fmt: skip
    a("--threshold", type=float, default=d.threshold, help="re-partitioning's threshold")
    a("--patience", type=int, default=d.patience, help="re-partitioning's patience (steps)")
    a("--layers", type=int, default=d.num_layers, help="GPT transformer layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--heads", type=int, default=d.num_heads, help="attention heads")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    a("--microbatches", type=int, default=d.num_microbatches, help="micro-batches per step")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    config = RepartitionBenchConfig(
        num_steps=args.steps, slow_from=args.slow_from, window=args.window,
        slowdown=args.slowdown, block_ms=args.block_ms, threshold=args.threshold,
        patience=args.patience,
        num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
        seq_len=args.seq_len, batch_size=args.batch_size, num_microbatches=args.microbatches,
    )  # fmt: skip
    result = run_bench(config)
    if args.json:
        common.print_json(result)
        return 0
    rows = [
        ["before the slowdown", result["steps_per_s_before"]],
        ["slowed, repartition off", result["steps_per_s_slowed_off"]],
        ["slowed, repartition auto", result["steps_per_s_slowed_auto"]],
        [f"slowed, planned split {result['planned_partition']}", result["steps_per_s_planned"]],
    ]
    common.print_table(
        "re-partitioning against a worker slowed by half",
        ["run", "steps/s"],
        rows,
        footer=f"recovered fraction {result['recovered_fraction']:.2f} (target >= 0.8); "
        f"moves {result['moves']}",
    )
    return 0
