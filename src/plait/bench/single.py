"""Plait's engine on one device timed against the plain PyTorch loop a practitioner writes.

One worker builds the same `plait.models.GPT` (same seed) five ways and trains each on the
same batches with AdamW and the same clipping:

- `plait`: `parallelize` with `ParallelPlan(dp=1, pp=1, microbatches=1)` in the bench's
  dtype, AdamW fused where torch has the kernels (as `optimizer_impl=auto` builds it);
- `plait_compiled`: the same with `compile=True` (each block, `plait.train.compile`);
- `plain`: `loss = F.cross_entropy(...)`, `loss.backward()`, `clip_grad_norm_`,
  `opt.step()`, `opt.zero_grad(set_to_none=True)`, under autocast for bf16 and fp16 (and a
  `GradScaler` for fp16), AdamW as torch builds it by default;
- `plain_fused`: the same loop with `AdamW(fused=True)`;
- `plain_compiled`: fused AdamW and `model.compile()` on the whole model.

Two ways to interleave (`--interleave`):

- `step` (the default on the CPU): every variant is built once and warmed up, then each
  repeat is one round in which every variant takes `steps` steps one at a time, turn by
  turn (A B C A B C ...), the order rotating from round to round. On a shared CPU host the
  speed drifts by ±20% over seconds; blocks of consecutive steps see different drifts,
  steps taken turn by turn see the same.
- `block` (the default on a GPU): a repeat runs, for every variant in an order that
  rotates from repeat to repeat, `warmup` untimed steps then `steps` timed ones; each
  variant is built afresh for its block and freed after it, so no two hold memory at once
  (five copies of a 24-layer GPT with their optimizer state would not fit one GPU).

A variant's time in a repeat is the median of its steps there; the result gives each
variant's median over the repeats and its spread ((max - min) / median), and
`ratio_vs_best_plain`: plait's best configuration over the best plain loop (each chosen by
its median), the median of their per-repeat ratios; the same in CPU seconds of the worker
(`*_cpu_s`, `cpu_ratio_vs_best_plain`), which other work sharing a CPU host disturbs less.
The first step of every variant starts from the same weights on the same batch: the
losses must agree.
`mfu` is the model's FLOPs per step (`plait.cost.transformer_block_costs`, as the
simulator counts them) per second over the device's peak for the dtype, from a small
table of GPUs by name (null on the CPU or an unknown GPU); fp32 counts without TF32.

Limits: on a shared CPU host the timings move with the load (run it when the load is
low); compilation is not timed (it happens in the first warm-up step).
"""

from __future__ import annotations

import argparse
import functools
import gc
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common
from plait.bench import _single_runners as runners
from plait.device import synchronize
from plait.flags import deprecated_flag

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

__all__ = ["SingleBenchConfig", "SingleBenchResult", "add_arguments", "run", "run_bench"]

PLAIT = ("plait", "plait_compiled")
PLAIN = ("plain", "plain_fused", "plain_compiled")
DTYPES = ("fp32", "bf16", "fp16")
# dense peak FLOP/s of GPUs by a part of their name (first match), per dtype (fp32: no TF32)
PEAKS = (
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
)
_TOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}  # relative: compiled kernels round apart


@dataclass(frozen=True, kw_only=True)
class SingleBenchConfig:
    """What one single-device bench runs: the model, batch and dtype, and step counts."""

    num_layers: int = 4
    hidden: int = 256
    num_heads: int = 4
    seq_len: int = 128
    batch_size: int = 4
    vocab_size: int = 512
    dtype: str = "fp32"
    num_steps: int = 5
    num_warmup: int = 2
    num_repeats: int = 3
    compile: bool = True
    lr: float = 1e-3
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    interleave: str = "auto"  # "step", "block", or "auto": step on the CPU, block elsewhere

    def __post_init__(self) -> None:
        if self.interleave not in ("auto", "step", "block"):
            raise ValueError(f"interleave={self.interleave!r}: choose auto, step or block")
        for name in ("num_steps", "num_warmup", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_repeats < 3:
            raise ValueError(f"num_repeats={self.num_repeats}: use at least 3 (a median)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {list(DTYPES)}")
        self.gpt_config()  # validates the model size

    @property
    def variants(self) -> tuple[str, ...]:
        return (*PLAIT, *PLAIN) if self.compile else ("plait", "plain", "plain_fused")

    def gpt_config(self) -> Any:
        from plait.models import GPTConfig

        return GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len,
                         num_layers=self.num_layers, hidden=self.hidden,
                         num_heads=self.num_heads)  # fmt: skip


@dataclass(frozen=True)
class SingleBenchResult:
    """Per variant and repeat, the median step time (s); the first step's losses."""

    config: SingleBenchConfig
    device_name: str
    num_params: int
    flops_per_step: float
    times_s: dict[str, list[float]]
    losses: dict[str, float]
    peak_flops: float | None = None
    # the same per CPU seconds of this process: less moved than wall time by other work
    # sharing a CPU host (a GPU's steps are mostly waits for the device)
    cpu_s: dict[str, list[float]] = field(default_factory=dict)

    def step_s(self, variant: str) -> float | None:
        times = self.times_s.get(variant)
        return common.median(times) if times else None

    def spread(self, variant: str) -> float | None:
        times = self.times_s.get(variant)
        return (max(times) - min(times)) / common.median(times) if times else None

    def best(self, variants: tuple[str, ...]) -> str:
        return min((v for v in variants if v in self.times_s), key=self.step_s)  # type: ignore[arg-type]

    def ratios(self, times: dict[str, list[float]]) -> list[float]:
        """plait's best over the best plain loop (chosen by wall time), repeat by repeat."""
        ours, theirs = times[self.best(PLAIT)], times[self.best(PLAIN)]
        return [a / b for a, b in zip(ours, theirs, strict=True)]

    @property
    def loss_match(self) -> bool:
        ref, tol = self.losses["plain"], _TOL[self.config.dtype]
        return all(abs(v - ref) <= tol * (1.0 + abs(ref)) for v in self.losses.values())

    def mfu(self, variant: str) -> float | None:
        step = self.step_s(variant)
        if self.peak_flops is None or not step:
            return None
        return self.flops_per_step / step / self.peak_flops

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {f"{v}_step_s": self.step_s(v) for v in (*PLAIT, *PLAIN)}
        out |= {f"{v}_spread": self.spread(v) for v in (*PLAIT, *PLAIN)}
        ratios, cpu = self.ratios(self.times_s), self.ratios(self.cpu_s)
        out |= {f"{v}_cpu_s": common.median(t) for v, t in self.cpu_s.items()}
        out |= {
            "ratio_vs_best_plain": common.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
            "cpu_ratio_vs_best_plain": common.median(cpu),
            "best_plait": self.best(PLAIT),
            "best_plain": self.best(PLAIN),
            "mfu": self.mfu(self.best(PLAIT)),
            "plain_mfu": self.mfu(self.best(PLAIN)),
            "device": self.device_name,
            "num_params": self.num_params,
            "flops_per_step": self.flops_per_step,
            "model": {k: v for k, v in asdict(c).items() if k in _MODEL_FIELDS},
            "steps": c.num_steps, "warmup": c.num_warmup, "repeats": c.num_repeats,
            "times_s": self.times_s,
            "losses": self.losses,
            "loss_match": self.loss_match,
        }  # fmt: skip
        return out


_MODEL_FIELDS = ("num_layers", "hidden", "num_heads", "seq_len", "batch_size", "vocab_size",
                 "dtype", "lr", "grad_clip", "seed")  # fmt: skip


def run_bench(config: SingleBenchConfig) -> SingleBenchResult:
    """Launch one worker, time the variants in it, and summarize."""
    from plait.train import launch

    result: SingleBenchResult = launch(_worker, 1, config)[0]
    return result


def peak_flops(name: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of the GPU called `name` in `dtype`, if the table has it."""
    for part, peaks in PEAKS:
        if part in name:
            return peaks[dtype]
    return None


# ------------------------------------------------------------------ in the worker
def _worker(config: SingleBenchConfig) -> SingleBenchResult:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    _, device = init_worker(timeout_s=600.0, device=config.device)
    try:
        return _measure(config, device)
    finally:
        dist.destroy_process_group()


def _measure(config: SingleBenchConfig, device: torch.device) -> SingleBenchResult:
    """Every variant, a block each per repeat, in rotating order."""
    from plait.device import device_name

    context = runners.Context.build(config, device)
    variants = config.variants
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, float] = {}
    by_step = config.interleave == "step" or (config.interleave == "auto" and device.type == "cpu")
    rounds = _rounds(context) if by_step else _blocks(context)
    for round_ in rounds:
        for variant, block, first in round_:
            losses.setdefault(variant, first)
            times[variant].append(common.median([t.wall_s for t in block]))
            cpu[variant].append(common.median([t.cpu_s for t in block]))
    name = device_name(device)
    return SingleBenchResult(
        config=config, device_name=name, num_params=context.num_params,
        flops_per_step=context.flops_per_step, times_s=times, losses=losses,
        peak_flops=peak_flops(name, config.dtype) if device.type != "cpu" else None,
        cpu_s=cpu,
    )  # fmt: skip


Round = list[tuple[str, list[common.Timing[None]], float]]  # (variant, timings, first loss)


def _blocks(context: runners.Context) -> Iterator[Round]:
    """A repeat: each variant built, warmed up and timed for a block of steps, in turn."""
    variants = context.config.variants
    for repeat in range(context.config.num_repeats):
        shift = repeat % len(variants)
        yield [(v, *_block(context, v)) for v in variants[shift:] + variants[:shift]]


def _rounds(context: runners.Context) -> Iterator[Round]:
    """Every variant built and warmed up once; a repeat gives each a step in turn."""
    config, device = context.config, context.device
    variants = config.variants
    built = {v: runners.build(v, context) for v in variants}
    first = {v: built[v].step(*common.token_batch(config, 0, device)) for v in variants}
    for i in range(1, config.num_warmup):
        for v in variants:
            built[v].step(*common.token_batch(config, i, device))
    for repeat in range(config.num_repeats):
        shift = repeat % len(variants)
        order = variants[shift:] + variants[:shift]
        timed: dict[str, list[common.Timing[None]]] = {v: [] for v in order}
        for i in range(config.num_steps):
            x, y = common.token_batch(config, config.num_warmup + repeat * config.num_steps + i,
                                      device)  # fmt: skip
            for v in order:
                synchronize(device)
                timed[v].append(common.timed(functools.partial(_step, built[v], x, y, device)))
        yield [(v, timed[v], first[v]) for v in order]


def _block(context: runners.Context, variant: str) -> tuple[list[common.Timing[None]], float]:
    """Build `variant`, warm it up, time its steps, free it: (their timings, first loss)."""
    from plait.device import release_memory

    config, device = context.config, context.device
    runner = runners.build(variant, context)
    first = runner.step(*common.token_batch(config, 0, device))
    for i in range(1, config.num_warmup):
        runner.step(*common.token_batch(config, i, device))
    times = []
    for i in range(config.num_steps):
        x, y = common.token_batch(config, config.num_warmup + i, device)
        synchronize(device)
        times.append(common.timed(functools.partial(_step, runner, x, y, device)))
    del runner
    gc.collect()
    release_memory(device)
    return times, first


def _step(runner: runners.Runner, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> None:
    runner.step(x, y)
    synchronize(device)


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SingleBenchConfig()
    a = parser.add_argument
    a("--layers", type=int, default=d.num_layers, help="GPT transformer layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--heads", type=int, default=d.num_heads, help="attention heads")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    a("--vocab", type=int, default=d.vocab_size, dest="vocab_size", help="GPT vocabulary size")
    deprecated_flag(parser, "--vocab-size", "--vocab", "vocab_size", type=int)
    a("--dtype", choices=DTYPES, default=d.dtype, help="training dtype (autocast for 16 bits)")
    a("--steps", type=int, default=d.num_steps, help="timed steps per variant and repeat")
    a("--warmup", type=int, default=d.num_warmup, help="untimed steps before them")
    a("--repeats", type=int, default=d.num_repeats, help="blocks per variant (at least 3)")
    a("--no-compile", action="store_true", help="skip the torch.compile variants")
    a("--device", default=d.device, help="auto, cpu or cuda (plait.device)")
    a("--interleave", choices=("auto", "step", "block"), default=d.interleave,
      help="take the variants' steps in turn (step), or each variant's block of steps in "
           "turn, built afresh (block); auto: step on the CPU, block on a GPU")  # fmt: skip
    a("--seed", type=int, default=d.seed, help="seed of the model and the data")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    config = SingleBenchConfig(
        num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
        seq_len=args.seq_len, batch_size=args.batch_size, vocab_size=args.vocab_size,
        dtype=args.dtype, num_steps=args.steps, num_warmup=args.warmup,
        num_repeats=args.repeats, compile=not args.no_compile, seed=args.seed,
        device=args.device, interleave=args.interleave,
    )  # fmt: skip
    return common.report(run_bench(config), as_json=args.json, table=_print_table)


def _print_table(result: SingleBenchResult) -> None:
    c = result.config
    rows = [
        [v, result.step_s(v), min(result.times_s[v]), max(result.times_s[v]),
         f"{result.losses[v]:.6f}"]
        for v in result.times_s
    ]  # fmt: skip
    d = result.to_dict()
    mfu = f"; MFU {d['mfu']:.1%} (plain {d['plain_mfu']:.1%})" if d["mfu"] is not None else ""
    common.print_table(
        f"one device ({result.device_name}): GPT {result.num_params / 1e6:.1f}M parameters, "
        f"batch {c.batch_size} × {c.seq_len}, {c.dtype}, {c.num_repeats} repeats of "
        f"{c.num_steps} steps",
        ["variant", "median step (s)", "min (s)", "max (s)", "first loss"],
        rows,
        footer=f"{d['best_plait']} / {d['best_plain']}: {d['ratio_vs_best_plain']:.3f} "
        f"(per repeat {d['ratio_spread'][0]:.3f} to {d['ratio_spread'][1]:.3f}; CPU time "
        f"{d['cpu_ratio_vs_best_plain']:.3f}){mfu}; "
        f"first-step losses {'match' if result.loss_match else 'DIFFER'}",
    )
