"""Plait's pipeline executor timed against torch.distributed.pipelining on one model and data.

Each of `--pp` workers builds two copies of one GPT (same seed), cut into the same
stages by plait's `local_stages`: one runs under plait's `PipelineExecutor`, the other
under torch's `PipelineStage` and the schedule of the same name (`ScheduleGPipe`,
`Schedule1F1B`, `ScheduleInterleaved1F1B`, `ScheduleZBVZeroBubble` for ZB-V). Chimera has
no peer in torch: it is timed against torch's `Schedule1F1B` on the same model, stages and
micro-batches (plait's step includes the sum of each part's two replicas' gradients,
`plait.parallel.replicas`). Both train with SGD on the same batches. After
warm-up, steps alternate (plait first on even steps, torch first on odd ones) so that
machine noise hits both alike; a timed step is zero_grad, pipeline step and optimizer
step, begins after a barrier and lasts as long as its slowest rank. Plait scales each
micro-batch's mean loss by 1/m before its backward, torch divides the gradients by m at
the end (`scale_grads=True`): the first step's losses and gradients must agree.

Limits: torch's interleaved schedule orders actions by its own rules (rounds of `stages`
micro-batches), which may differ from plait's in detail; workers on a CPU share its
cores, so ratios, not absolute times, carry over to other machines.
"""

from __future__ import annotations

import argparse
import functools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common
from plait.bench.pipeline_config import (
    _TORCH_PEER,
    SCHEDULES,
    PipelineBenchConfig,
    PipelineBenchResult,
)
from plait.device import synchronize
from plait.flags import deprecated_flag

if TYPE_CHECKING:
    import torch

__all__ = ["add_arguments", "run", "run_bench"]


def run_bench(config: PipelineBenchConfig) -> PipelineBenchResult:
    """Launch `config.num_stages` workers, time both runtimes in them, and summarize."""
    from plait.train import launch

    per_rank = launch(_worker, config.num_stages, config)
    reports = [per_rank[r] for r in sorted(per_rank)]
    # the mean loss over the ranks holding last stages (Chimera: two, with m/2 micro-batches
    # each for even m; ZB-V: rank 0)
    plait_losses = [r["plait_loss"] for r in reports if r["plait_loss"] is not None]
    torch_losses = [r["torch_loss"] for r in reports if r["torch_loss"] is not None]
    return PipelineBenchResult(
        config=config,
        plait_times_s=common.across_ranks([r["plait_times_s"] for r in reports], max),
        torch_times_s=common.across_ranks([r["torch_times_s"] for r in reports], max),
        plait_cpu_s=common.across_ranks([r["plait_cpu_s"] for r in reports], sum),
        torch_cpu_s=common.across_ranks([r["torch_cpu_s"] for r in reports], sum),
        plait_loss=sum(plait_losses) / len(plait_losses),
        torch_loss=sum(torch_losses) / len(torch_losses),
        grad_max_diff=max(r["grad_max_diff"] for r in reports),
    )


# ------------------------------------------------------------------ in the workers
def _worker(config: PipelineBenchConfig) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    env, device = init_worker(timeout_s=120.0)
    try:
        return _measure(config, env.rank, device)
    finally:
        dist.destroy_process_group()


def _measure(config: PipelineBenchConfig, rank: int, device: torch.device) -> dict[str, Any]:
    """Alternate plait and torch steps on the same batches; this rank's times and losses."""
    import torch.distributed as dist

    runners = {
        "plait": _PlaitRunner(config, rank, device),
        "torch": _TorchRunner(config, rank, device),
    }
    out: dict[str, Any] = {f"{n}_{k}": [] for n in runners for k in ("times_s", "cpu_s")}
    for i in range(config.num_warmup + config.num_steps):
        x, y = common.token_batch(config, i, device)
        for name in ("plait", "torch") if i % 2 == 0 else ("torch", "plait"):
            dist.barrier()
            t = common.timed(functools.partial(runners[name].step, x, y, device))
            if i == 0:
                out[f"{name}_loss"] = t.value
            if i >= config.num_warmup:
                out[f"{name}_times_s"].append(t.wall_s)
                out[f"{name}_cpu_s"].append(t.cpu_s)
        if i == 0:
            out["grad_max_diff"] = common.max_grad_diff(*_same_parts(runners))
    return out


def _same_parts(runners: dict[str, _Runner]) -> tuple[list[Any], list[Any]]:
    """The stage modules of both runtimes that compute the same model part on this rank."""
    plait, torch = runners["plait"], runners["torch"]
    mine = {plait.schedule.parts[s]: m for s, m in sorted(plait.stages.items())}
    theirs = {torch.schedule.parts[s]: m for s, m in sorted(torch.stages.items())}
    shared = sorted(set(mine) & set(theirs))
    return [mine[k] for k in shared], [theirs[k] for k in shared]


class _Runner(ABC):
    """One runtime's copy of the model on this rank: its stages and their optimizer."""

    def __init__(
        self, config: PipelineBenchConfig, rank: int, device: torch.device, kind: str
    ) -> None:
        import torch

        from plait.models import GPT
        from plait.runtime import local_stages
        from plait.schedule import build

        c = config
        chunks = c.num_chunks if kind == c.schedule else 1
        self.schedule = build(kind, c.num_stages, c.num_microbatches, chunks)
        torch.manual_seed(c.seed)
        model = GPT(c.gpt_config())
        self.stages = local_stages(model, self.schedule, rank, device=device)
        params = [p for s in self.stages.values() for p in s.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=c.lr)
        self.has_first = any(self.schedule.is_first(s) for s in self.stages)
        self.has_last = any(self.schedule.is_last(s) for s in self.stages)

    def step(self, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float | None:
        """zero_grad, one pipeline step, optimizer step; the batch loss on the last rank."""

        self.optimizer.zero_grad()
        loss = self._pipeline_step(x, y)
        self.optimizer.step()
        synchronize(device)
        return loss

    @abstractmethod
    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None: ...


class _PlaitRunner(_Runner):
    def __init__(self, config: PipelineBenchConfig, rank: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from plait.models import GPT
        from plait.parallel.replicas import with_replicas
        from plait.runtime import PipelineExecutor

        super().__init__(config, rank, device, config.schedule)
        mesh = init_device_mesh(device.type, (config.num_stages,), mesh_dim_names=("pp",))
        self.grad_sync = with_replicas(None, self.schedule, self.stages, mesh)
        self.executor = PipelineExecutor(
            self.schedule,
            dict(self.stages),
            rank=rank,
            loss_fn=GPT.loss,
            device=device,
            grad_sync=self.grad_sync,
        )

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        from plait.runtime import split_microbatches

        m = self.schedule.num_microbatches
        result = self.executor.step(
            split_microbatches(x, m) if self.has_first else None,
            split_microbatches(y, m) if self.has_last else None,
        )
        if self.grad_sync is not None:  # the sum of replicas' gradients (Chimera)
            self.grad_sync.finish()
        return float(result.loss) if result.loss is not None else None


class _TorchRunner(_Runner):
    def __init__(self, config: PipelineBenchConfig, rank: int, device: torch.device) -> None:
        from torch.distributed import pipelining as pp

        from plait.models import GPT

        kind = _TORCH_PEER.get(config.schedule, config.schedule)
        super().__init__(config, rank, device, kind)
        n, m = self.schedule.num_stages, self.schedule.num_microbatches
        stages: list[Any] = [
            pp.PipelineStage(mod, s, n, device) for s, mod in sorted(self.stages.items())
        ]
        if kind == "interleaved":
            self.pipe: Any = pp.ScheduleInterleaved1F1B(stages, m, loss_fn=GPT.loss)
        elif kind == "zb-v":
            self.pipe = pp.ScheduleZBVZeroBubble(stages, m, loss_fn=GPT.loss)
        else:
            single = pp.ScheduleGPipe if kind == "gpipe" else pp.Schedule1F1B
            self.pipe = single(stages[0], m, loss_fn=GPT.loss)

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.has_last else {}
        self.pipe.step(*args, return_outputs=False, **kwargs)
        if not self.has_last:
            return None
        return sum(float(loss.detach()) for loss in losses) / len(losses)


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PipelineBenchConfig()
    a = parser.add_argument
    a("--schedule", choices=SCHEDULES, default=d.schedule, help="pipeline schedule of both")
    a(
        "--pp",
        type=int,
        default=d.num_stages,
        dest="stages",
        help="pipeline ranks (local worker processes)",
    )
    deprecated_flag(parser, "--stages", "--pp", "stages", type=int)
    a("--microbatches", type=int, default=d.num_microbatches, help="micro-batches per step")
    a("--chunks", type=int, help="virtual stages per rank (default: 2 if interleaved or zb-v)")
    a("--steps", type=int, default=d.num_steps, help="timed steps of each runtime")
    a("--warmup", type=int, default=d.num_warmup, help="untimed steps of each runtime first")
    a("--layers", type=int, default=d.num_layers, help="GPT transformer layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--heads", type=int, default=d.num_heads, help="attention heads")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step (all micro-batches)")
    a("--vocab", type=int, default=d.vocab_size, dest="vocab_size", help="GPT vocabulary size")
    deprecated_flag(parser, "--vocab-size", "--vocab", "vocab_size", type=int)
    a("--seed", type=int, default=d.seed, help="seed of the model and the data")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def _config_from_args(args: argparse.Namespace) -> PipelineBenchConfig:
    from plait.schedule import schedule_kind

    chunks = schedule_kind(args.schedule).chunks(args.chunks)
    return PipelineBenchConfig(
        schedule=args.schedule,
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        num_chunks=chunks,
        num_steps=args.steps,
        num_warmup=args.warmup,
        num_layers=args.layers,
        hidden=args.hidden,
        num_heads=args.heads,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    result = run_bench(_config_from_args(args))
    return common.report(result, as_json=args.json, table=_print_table)


def _print_table(result: PipelineBenchResult) -> None:
    c = result.config
    rows = [
        [name, common.median(times), min(times), max(times), common.median(cpu), f"{loss:.6f}"]
        for name, times, cpu, loss in (
            ("plait", result.plait_times_s, result.plait_cpu_s, result.plait_loss),
            ("torch", result.torch_times_s, result.torch_cpu_s, result.torch_loss),
        )
    ]
    common.print_table(
        f"{c.schedule}: {c.num_stages} stages × {c.num_chunks} chunks, "
        f"{c.num_microbatches} micro-batches, {c.num_steps} timed steps",
        ["runtime", "median step (s)", "min (s)", "max (s)", "CPU, all ranks (s)", "loss"],
        rows,
        footer=f"ratio plait / torch: {result.ratio:.3f} (step by step {result.paired_ratio:.3f}, "
        f"CPU time {result.cpu_ratio:.3f}); first-step "
        f"losses {'match' if result.loss_match else 'DIFFER'}, gradients differ by at most "
        f"{result.grad_max_diff:.1e}",
    )
