"""What the compression bench runs: the methods, workers, model and steps, checked before
any worker starts; and the methods DDP runs as its peer."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PEERS", "CompressBenchConfig"]

# methods DDP runs with torch's same hook; "none" is DDP's own all-reduce, the control that
# tells plait's general per-step cost from its hooks'
PEERS = ("none", "fp16", "powersgd")


@dataclass(frozen=True, kw_only=True)
class CompressBenchConfig:
    workers: tuple[int, ...] = (2, 4)
    methods: tuple[str, ...] = (
        "none", "fp16", "bf16", "powersgd:4", "threshold:0.005", "threshold:0.05", "topk:0.01",
        "sign", "dgc:0.001", "dgc:0.001:global-topk",
    )  # fmt: skip
    num_steps: int = 100
    num_warmup: int = 3
    num_layers: int = 2
    hidden: int = 128
    num_heads: int = 4
    seq_len: int = 64
    batch_size: int = 16
    # SGD with momentum 0.9, as Ström ran the threshold method (Adam normalises its sparse
    # ±τ messages into full-size steps); "adamw" with its own lr, e.g. 3e-3
    optimizer: str = "sgd"
    lr: float = 0.03
    seed: int = 0

    def __post_init__(self) -> None:
        from plait.compression import parse_compression

        if "none" not in self.methods:
            raise ValueError(f"methods={self.methods}: include 'none', the baseline")
        for m in self.methods:
            parse_compression(m)
        for w in self.workers:
            if w < 2 or self.batch_size % w:
                raise ValueError(
                    f"workers={w}: give at least 2, dividing batch_size={self.batch_size}"
                )
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r}: give adamw or sgd")
        if self.num_steps < 5:
            raise ValueError(f"num_steps={self.num_steps}: the loss is the mean of the last 5")
        if not 0 <= self.num_warmup < self.num_steps:
            raise ValueError(f"num_warmup={self.num_warmup} must lie in [0, num_steps)")
        if self.batch_size < 1 or not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"batch_size={self.batch_size} must be >= 1, lr={self.lr} positive")
        from plait.models import GPTConfig

        GPTConfig(
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            hidden=self.hidden,
            num_heads=self.num_heads,
        )  # validates the model size
