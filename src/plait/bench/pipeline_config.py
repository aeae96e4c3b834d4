"""What the pipeline bench runs (schedules, model, steps) and what it reports per schedule."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from plait.bench import _common as common

__all__ = ["SCHEDULES", "PipelineBenchConfig", "PipelineBenchResult"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-v", "chimera")
# torch's schedule each plait schedule is timed against (Chimera has no torch peer)
_TORCH_PEER = {"chimera": "1f1b"}
_TOL = 1e-5  # absolute and relative tolerance of "the same loss / gradient" in fp32
_MODEL_FIELDS = ("num_layers", "hidden", "num_heads", "seq_len", "batch_size", "vocab_size",
                 "lr", "seed")  # fmt: skip
_RESULT_FIELDS = ("plait_step_s", "torch_step_s", "ratio", "paired_ratio", "cpu_ratio",
                  "plait_loss", "torch_loss", "loss_match", "grad_max_diff", "plait_times_s",
                  "torch_times_s")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PipelineBenchConfig:
    """What one pipeline bench runs: schedule, pipeline shape, model size and step counts."""

    schedule: str = "1f1b"
    num_stages: int = 2
    num_microbatches: int = 8
    num_chunks: int = 1
    num_steps: int = 30  # 10 gave ratios from 0.93 to 1.04 on one quiet 2-core host
    num_warmup: int = 2
    num_layers: int = 8
    hidden: int = 256
    num_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    vocab_size: int = 512
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: choose one of {list(SCHEDULES)}")
        for name in ("num_stages", "num_microbatches", "num_chunks", "num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup={self.num_warmup} must be >= 0")
        if self.batch_size % self.num_microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by num_microbatches="
                f"{self.num_microbatches}: use a batch size that is a multiple of it"
            )
        self.gpt_config()  # validates the model size
        num_blocks, num_virtual = self.num_layers + 2, self.num_stages * self.num_chunks
        if num_blocks < num_virtual:
            raise ValueError(
                f"the GPT has {num_blocks} blocks (num_layers={self.num_layers} + embedding + "
                f"head), fewer than stages × chunks = {num_virtual}: use num_layers >= "
                f"{num_virtual - 2}, or fewer stages or chunks"
            )
        self._check_torch_limits()
        from plait.schedule import build

        build(self.schedule, self.num_stages, self.num_microbatches, self.num_chunks)

    def _check_torch_limits(self) -> None:
        """What torch.distributed.pipelining's schedules refuse, said before workers start."""
        p, m = self.num_stages, self.num_microbatches
        if self.schedule in ("1f1b", "chimera") and m < p:
            raise ValueError(
                f"num_microbatches={m} is smaller than stages={p}: torch's Schedule1F1B "
                f"needs at least {p} micro-batches (or use --schedule gpipe)"
            )
        rounds = max(1, m // p)
        if self.schedule == "interleaved" and m % rounds:
            raise ValueError(
                f"num_microbatches={m} is not a multiple of {rounds} rounds (m // stages): "
                f"torch's ScheduleInterleaved1F1B needs that; use a multiple of stages={p}"
            )

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
class PipelineBenchResult:
    """Per timed step, both runtimes' wall time (slowest rank) and CPU time (all ranks), in
    seconds; the first step's losses and the largest gradient difference after it."""

    config: PipelineBenchConfig
    plait_times_s: list[float]
    torch_times_s: list[float]
    plait_cpu_s: list[float]
    torch_cpu_s: list[float]
    plait_loss: float
    torch_loss: float
    grad_max_diff: float

    @property
    def plait_step_s(self) -> float:
        return common.median(self.plait_times_s)

    @property
    def torch_step_s(self) -> float:
        return common.median(self.torch_times_s)

    @property
    def ratio(self) -> float:
        return self.plait_step_s / self.torch_step_s

    @property
    def paired_ratio(self) -> float:
        """Median of per-step ratios: both step i ran back to back, so slow noise cancels."""
        pairs = zip(self.plait_times_s, self.torch_times_s, strict=True)
        return common.median([p / t for p, t in pairs])

    @property
    def cpu_ratio(self) -> float:
        return common.median(self.plait_cpu_s) / common.median(self.torch_cpu_s)

    @property
    def loss_match(self) -> bool:
        return abs(self.plait_loss - self.torch_loss) <= _TOL * (1.0 + abs(self.torch_loss))

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        out = {
            "schedule": c.schedule,
            "stages": c.num_stages,
            "microbatches": c.num_microbatches,
            "chunks": c.num_chunks,
            "steps": c.num_steps,
            "warmup": c.num_warmup,
            "plait_cpu_s": common.median(self.plait_cpu_s),
            "torch_cpu_s": common.median(self.torch_cpu_s),
            "grad_match": self.grad_max_diff <= _TOL,
            "model": {k: v for k, v in asdict(c).items() if k in _MODEL_FIELDS},
        }
        out.update({k: getattr(self, k) for k in _RESULT_FIELDS})
        return out
