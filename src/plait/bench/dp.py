"""Plait's data-parallel engine timed against torch DDP and FSDP2 on one model and data.

Each of `--workers` processes builds three copies of one GPT (same seed) and one
optimizer per copy: plait's `parallelize` with `ParallelPlan(dp=workers, pp=1,
microbatches=1, zero=0)` (one stage, gradients averaged by plait's bucketed reducer while
the backward runs), torch's `DistributedDataParallel` around the whole model, and FSDP2
(`fully_shard` on every transformer block, then on the root, as torchtitan does; ZeRO-3).
Every rank trains on its own slice of the same global batches. After warm-up the three
take turns (the order rotates every step) so that machine noise hits all alike; a timed
step is zero_grad, forward, backward, gradient reduction and optimizer step, begins
after a barrier and lasts as long as its slowest rank. Plait's step also averages the
loss over data parallel (one small all-reduce); the peers' steps do not, as a usual
training loop does not. The first step's losses, and the gradients after it, must agree.

Limits: workers on a CPU share its cores and gloo's all-reduce runs on them too, so
ratios, not absolute times, carry over to other machines; FSDP2 trades memory for an
all-gather per block, which it cannot hide on a CPU as it can on a GPU.
"""

from __future__ import annotations

import argparse
import functools
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common
from plait.flags import deprecated_flag

if TYPE_CHECKING:
    import torch

__all__ = ["DPBenchConfig", "DPBenchResult", "add_arguments", "run", "run_bench"]

RUNTIMES = ("plait", "ddp", "fsdp")
OPTIMIZERS = ("adamw", "sgd")
_TOL = 1e-5  # absolute and relative tolerance of "the same loss / gradient" in fp32


@dataclass(frozen=True, kw_only=True)
class DPBenchConfig:
    """What one data-parallel bench runs: workers, model size, optimizer and step counts."""

    num_workers: int = 2
    num_steps: int = 12
    num_warmup: int = 2
    num_layers: int = 6
    hidden: int = 256
    num_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    vocab_size: int = 512
    optimizer: str = "adamw"
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_workers", "num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup={self.num_warmup} must be >= 0")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {list(OPTIMIZERS)}")
        if self.batch_size % self.num_workers:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by num_workers="
                f"{self.num_workers}: use a batch size that is a multiple of it"
            )
        self.gpt_config()  # validates the model size

    def gpt_config(self) -> Any:
        from plait.models import GPTConfig

        return GPTConfig(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            hidden=self.hidden,
            num_heads=self.num_heads,
        )


@dataclass(frozen=True)
class DPBenchResult:
    """Per runtime and timed step, the wall time (slowest rank) and CPU time (all ranks) in
    seconds; the first step's global losses and the largest gradient differences after it."""

    config: DPBenchConfig
    num_params: int
    times_s: dict[str, list[float]]
    cpu_s: dict[str, list[float]]
    losses: dict[str, float]
    grad_max_diff: dict[str, float]  # "plait" and "fsdp", each against DDP's gradients

    def step_s(self, runtime: str) -> float:
        return common.median(self.times_s[runtime])

    @property
    def loss_match(self) -> bool:
        ref = self.losses["ddp"]
        return all(abs(v - ref) <= _TOL * (1.0 + abs(ref)) for v in self.losses.values())

    @property
    def grad_match(self) -> bool:
        return max(self.grad_max_diff.values()) <= _TOL

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {
            "workers": c.num_workers,
            "steps": c.num_steps,
            "warmup": c.num_warmup,
            "num_params": self.num_params,
            "model": {k: v for k, v in asdict(c).items() if k in _MODEL_FIELDS},
            "ratio_vs_ddp": self.step_s("plait") / self.step_s("ddp"),
            "ratio_vs_fsdp": self.step_s("plait") / self.step_s("fsdp"),
            "cpu_ratio_vs_ddp": common.median(self.cpu_s["plait"])
            / common.median(self.cpu_s["ddp"]),
            "loss_match": self.loss_match,
            "grad_match": self.grad_match,
            "grad_max_diff": self.grad_max_diff,
        }
        for name in RUNTIMES:
            out[f"{name}_step_s"] = self.step_s(name)
            out[f"{name}_cpu_s"] = common.median(self.cpu_s[name])
            out[f"{name}_loss"] = self.losses[name]
            out[f"{name}_times_s"] = self.times_s[name]
        return out


_MODEL_FIELDS = ("num_layers", "hidden", "num_heads", "seq_len", "batch_size", "vocab_size",
                 "optimizer", "lr", "seed")  # fmt: skip


def run_bench(config: DPBenchConfig) -> DPBenchResult:
    """Launch `config.num_workers` workers, time the three runtimes in them, and summarize."""
    from plait.train import launch

    per_rank = launch(_worker, config.num_workers, config)
    reports = [per_rank[r] for r in sorted(per_rank)]
    first = reports[0]
    return DPBenchResult(
        config=config,
        num_params=first["num_params"],
        times_s={n: common.across_ranks([r["times_s"][n] for r in reports], max) for n in RUNTIMES},
        cpu_s={n: common.across_ranks([r["cpu_s"][n] for r in reports], sum) for n in RUNTIMES},
        # plait reports the global loss; the peers each rank's loss on its equal share
        losses={
            "plait": first["loss"]["plait"],
            **{n: sum(r["loss"][n] for r in reports) / len(reports) for n in ("ddp", "fsdp")},
        },
        grad_max_diff={n: max(r["grad_max_diff"][n] for r in reports) for n in ("plait", "fsdp")},
    )


# ------------------------------------------------------------------ in the workers
def _worker(config: DPBenchConfig) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    env, device = init_worker(timeout_s=120.0)
    try:
        return _measure(config, env.rank, device)
    finally:
        dist.destroy_process_group()


def _measure(config: DPBenchConfig, rank: int, device: torch.device) -> dict[str, Any]:
    """Rotate the three runtimes over the same batches; this rank's times and losses."""
    import torch.distributed as dist

    runners: dict[str, _Runner] = {
        "plait": _PlaitRunner(config, rank, device),
        "ddp": _DDPRunner(config, rank, device),
        "fsdp": _FSDPRunner(config, rank, device),
    }
    out: dict[str, Any] = {"times_s": {n: [] for n in RUNTIMES}, "cpu_s": {n: [] for n in RUNTIMES}}
    out["num_params"] = sum(p.numel() for p in runners["ddp"].model.parameters())
    for i in range(config.num_warmup + config.num_steps):
        x, y = common.token_batch(config, i, device)
        shift = i % len(RUNTIMES)
        for name in RUNTIMES[shift:] + RUNTIMES[:shift]:
            dist.barrier()
            t = common.timed(functools.partial(runners[name].step, x, y))
            if i == 0:
                out.setdefault("loss", {})[name] = t.value
            if i >= config.num_warmup:
                out["times_s"][name].append(t.wall_s)
                out["cpu_s"][name].append(t.cpu_s)
        if i == 0:
            reference = runners["ddp"].grads()
            out["grad_max_diff"] = {
                n: _max_diff(runners[n].grads(), reference) for n in ("plait", "fsdp")
            }
    return out


def _max_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """Largest |a - b| over matching gradients (inf if only one of a pair exists)."""
    worst = 0.0
    for p, q in zip(a, b, strict=True):
        if (p is None) != (q is None):
            return float("inf")
        if p is not None and q is not None:
            worst = max(worst, float((p - q).abs().max()))
    return worst


class _Runner(ABC):
    """One runtime's replica of the GPT on this rank, and its optimizer."""

    def __init__(self, config: DPBenchConfig, rank: int, device: torch.device) -> None:
        import torch

        from plait.models import GPT

        self.config, self.rank, self.device = config, rank, device
        torch.manual_seed(config.seed)
        self.model = GPT(config.gpt_config()).to(device)

    def _optimizer(self, params: Any) -> torch.optim.Optimizer:
        import torch

        if self.config.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.config.lr)
        return torch.optim.AdamW(params, lr=self.config.lr)

    @abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """zero_grad, forward, backward, gradient reduction, optimizer step; the loss (plait:
        the global batch's, peers: this rank's share's)."""
        ...

    def grads(self) -> list[torch.Tensor | None]:
        """Every parameter's whole gradient, in the model's parameter order."""
        return [p.grad for p in self.model.parameters()]

    def _sync(self) -> None:
        from plait.device import synchronize

        synchronize(self.device)


class _PlaitRunner(_Runner):
    def __init__(self, config: DPBenchConfig, rank: int, device: torch.device) -> None:
        from plait.config import ParallelPlan
        from plait.models import GPT
        from plait.train.parallelize import parallelize

        super().__init__(config, rank, device)
        plan = ParallelPlan(dp=config.num_workers, tp=1, pp=1, microbatches=1, zero=0)
        self.engine = parallelize(self.model, plan, self._optimizer, GPT.loss, device=device)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.engine.step((x, y)).loss
        self._sync()
        return loss

    def grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.engine.params]


class _PeerRunner(_Runner):
    """A torch runtime that wraps the model itself; each rank slices its share of dim 0."""

    wrapped: Any
    optimizer: torch.optim.Optimizer

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        from plait.models import GPT

        n = self.config.num_workers
        self.optimizer.zero_grad(set_to_none=True)
        loss = GPT.loss(self.wrapped(x.chunk(n)[self.rank]), y.chunk(n)[self.rank])
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self._sync()
        return float(loss.detach())


class _DDPRunner(_PeerRunner):
    def __init__(self, config: DPBenchConfig, rank: int, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(config, rank, device)
        from plait.device import device_ids

        self.wrapped = DistributedDataParallel(self.model, device_ids=device_ids(device))
        self.optimizer = self._optimizer(self.wrapped.parameters())


class _FSDPRunner(_PeerRunner):
    def __init__(self, config: DPBenchConfig, rank: int, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from plait.models.gpt import TransformerBlock

        super().__init__(config, rank, device)
        mesh = init_device_mesh(device.type, (config.num_workers,), mesh_dim_names=("dp",))
        for block in self.model.layers:
            if isinstance(block, TransformerBlock):
                fully_shard(block, mesh=mesh)
        self.wrapped = fully_shard(self.model, mesh=mesh)
        self.optimizer = self._optimizer(self.model.parameters())

    def grads(self) -> list[torch.Tensor | None]:
        """Whole gradients from the DTensor shards (a collective: every rank calls it)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.model.parameters()]
        return [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DPBenchConfig()
    a = parser.add_argument
    a("--workers", type=int, default=d.num_workers, help="data-parallel ranks (local processes)")
    a("--steps", type=int, default=d.num_steps, help="timed steps of each runtime")
    a("--warmup", type=int, default=d.num_warmup, help="untimed steps of each runtime first")
    a("--layers", type=int, default=d.num_layers, help="GPT transformer layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--heads", type=int, default=d.num_heads, help="attention heads")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step (all ranks)")
    a("--vocab", type=int, default=d.vocab_size, dest="vocab_size", help="GPT vocabulary size")
    deprecated_flag(parser, "--vocab-size", "--vocab", "vocab_size", type=int)
    a("--optimizer", choices=OPTIMIZERS, default=d.optimizer, help="optimizer of all three")
    a("--seed", type=int, default=d.seed, help="seed of the model and the data")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def _config_from_args(args: argparse.Namespace) -> DPBenchConfig:
    return DPBenchConfig(
        num_workers=args.workers,
        num_steps=args.steps,
        num_warmup=args.warmup,
        num_layers=args.layers,
        hidden=args.hidden,
        num_heads=args.heads,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        vocab_size=args.vocab_size,
        optimizer=args.optimizer,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    result = run_bench(_config_from_args(args))
    return common.report(result, as_json=args.json, table=_print_table)


def _print_table(result: DPBenchResult) -> None:
    c = result.config
    rows = [
        [
            name,
            result.step_s(name),
            min(result.times_s[name]),
            max(result.times_s[name]),
            common.median(result.cpu_s[name]),
            f"{result.losses[name]:.6f}",
        ]
        for name in RUNTIMES
    ]
    d = result.to_dict()
    common.print_table(
        f"data parallel over {c.num_workers} workers: GPT {result.num_params / 1e6:.1f}M "
        f"parameters, batch {c.batch_size}, {c.optimizer}, {c.num_steps} timed steps",
        ["runtime", "median step (s)", "min (s)", "max (s)", "CPU, all ranks (s)", "loss"],
        rows,
        footer=f"plait / DDP: {d['ratio_vs_ddp']:.3f} (CPU time {d['cpu_ratio_vs_ddp']:.3f}); "
        f"plait / FSDP2: {d['ratio_vs_fsdp']:.3f}; first-step losses "
        f"{'match' if result.loss_match else 'DIFFER'}, gradients differ from DDP's by at "
        f"most {max(result.grad_max_diff.values()):.1e}",
    )
