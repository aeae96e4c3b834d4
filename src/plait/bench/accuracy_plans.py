"""The grid the sim-accuracy bench runs (`AccuracyConfig`) and the record of one plan's run,
measured and predicted (`PlanRun`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SCHEDULES", "AccuracyConfig", "PlanRun"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # the default grid


@dataclass(frozen=True, kw_only=True)
class AccuracyConfig:
    """The grid (schedules × micro-batch counts × world sizes), the model and step counts."""

    schedules: tuple[str, ...] = SCHEDULES
    microbatches: tuple[int, ...] = (4, 8)
    worlds: tuple[int, ...] = (2, 4)
    num_steps: int = 3
    num_warmup: int = 1
    rounds: int = 3
    num_layers: int = 6
    hidden: int = 128
    num_heads: int = 4
    seq_len: int = 64
    vocab_size: int = 256
    micro_batch_size: int = 4
    profile_repeats: int = 9
    seed: int = 0

    def __post_init__(self) -> None:
        from plait.schedule import kind_names

        known = kind_names(synchronous=True)  # one window is one step to time
        if not self.schedules or not set(self.schedules) <= set(known):
            raise ValueError(f"schedules {list(self.schedules)}: choose from {list(known)}")
        counts = (*self.microbatches, self.num_steps, self.profile_repeats, self.num_warmup + 1,
                  self.rounds, self.micro_batch_size)  # fmt: skip
        if not (self.microbatches and self.worlds) or min(counts) < 1 or min(self.worlds) < 2:
            raise ValueError(
                f"microbatches={list(self.microbatches)}, steps, profile repeats and "
                f"micro_batch_size={self.micro_batch_size} must be "
                f">= 1, warm-up >= 0, worlds={list(self.worlds)} >= 2"
            )
        from plait.schedule import schedule_kind

        chunks = max(schedule_kind(k).default_chunks for k in self.schedules)
        stages = max(self.worlds) * chunks
        if self.num_layers + 2 < stages:
            raise ValueError(
                f"layers={self.num_layers}: {stages} pipeline stages need {stages} blocks; "
                f"use at least {stages - 2} layers"
            )
        self.spec()  # validates the model sizes

    def spec(self) -> Any:
        from plait.profile import GPTSpec

        return GPTSpec(num_layers=self.num_layers, hidden=self.hidden, num_heads=self.num_heads,
                       seq_len=self.seq_len, vocab_size=self.vocab_size)  # fmt: skip


@dataclass(frozen=True)
class PlanRun:
    """One plan: what the workers run, what they measured, what the simulator said."""

    schedule: str
    pp: int
    num_microbatches: int
    num_chunks: int
    sizes: tuple[int, ...]
    measured_s: float = 0.0
    predicted_s: float = 0.0
    predicted_bubble: float = 0.0
    step_times_s: tuple[float, ...] = ()
    measured: tuple[Any, ...] = field(default=(), repr=False)  # spans of the last step
    predicted: tuple[Any, ...] = field(default=(), repr=False)

    @property
    def name(self) -> str:
        return f"{self.schedule} pp={self.pp} m={self.num_microbatches}"

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    def row(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("measured", "predicted")}
        return {"plan": self.name, "error": self.error, **out}
