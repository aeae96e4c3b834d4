"""What the MoE bench runs: worker counts, the layer's shape, steps and precision, checked
before any worker starts."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoEBenchConfig"]


@dataclass(frozen=True, kw_only=True)
class MoEBenchConfig:
    workers: tuple[int, ...] = (1, 2)
    tokens: int = 512  # per rank
    hidden: int = 256
    ffn: int = 768
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 0.0  # dropless, as torchtitan routes
    num_steps: int = 20
    num_warmup: int = 3
    # plait's precision: bf16 autocast (its `--dtype bf16`) computes the experts in bf16
    # and keeps the router in fp32, as the peer always does; fp32 computes all in fp32
    dtype: str = "bf16"
    peer: bool = True

    def __post_init__(self) -> None:
        from plait.models.moe import MoEConfig
        from plait.parallel.experts import check_expert_parallel

        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"workers={self.workers}: give worker counts >= 1")
        if self.tokens < 1 or self.num_steps < 1 or self.num_warmup < 0:
            raise ValueError(
                f"tokens={self.tokens}, steps={self.num_steps} must be >= 1, "
                f"warmup={self.num_warmup} >= 0"
            )
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype={self.dtype!r}: give fp32 or bf16")
        for w in self.workers:
            check_expert_parallel(self.num_experts, w)
        if self.peer and (self.hidden % 8 or self.peer_ffn < 8):
            raise ValueError(
                f"hidden={self.hidden}, ffn={self.ffn}: torchtitan's grouped GEMM needs a "
                "hidden size that is a multiple of 8 and ffn >= 12 (or give --no-peer)"
            )
        MoEConfig(hidden=self.hidden, num_heads=1, ffn_hidden=self.ffn,
                  num_experts=self.num_experts, top_k=self.top_k,
                  capacity_factor=self.capacity_factor)  # fmt: skip

    @property
    def peer_ffn(self) -> int:
        """The peer's SwiGLU width: 2/3 of `ffn`, a multiple of 8 (same parameters, FLOPs)."""
        return 2 * self.ffn // 3 // 8 * 8
