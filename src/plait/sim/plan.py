"""The plan the simulator evaluates: parallel degrees, schedule, batch and memory options.

`SimPlan` is plain data: the planner (plait.plan) builds one per candidate layout, the CLI
from flags. Global ranks follow Megatron-LM's order by default, tensor-parallel ranks
innermost (neighbours on one node), then data-parallel, then pipeline outermost.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cluster import normalize_dtype
from plait.compression import check_zero, parse_compression
from plait.cost import RECOMPUTE_MODES, Optimizer, Recompute
from plait.layout import RANK_ORDERS, check_ep, check_rank_order, global_rank

__all__ = ["RANK_ORDERS", "SimPlan"]


@dataclass(frozen=True, kw_only=True)
class SimPlan:
    """One training layout: `dp`×`tp`×`pp` ranks, `schedule` over `num_microbatches` of
    `micro_batch_size` samples (`seq_len` tokens each) per data-parallel rank and step.
    `ep` spreads experts over ep of the dp × tp ranks (`plait.layout`: it adds no ranks)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    num_microbatches: int = 1
    micro_batch_size: int = 1
    num_chunks: int = 1
    recompute: Recompute = "none"
    zero_stage: int = 0
    dtype: str = "bf16"
    sequence_parallel: bool = False
    optimizer: Optimizer = "adam"
    seq_len: int = 1
    rank_order: str = "tp-dp-pp"  # innermost axis first
    compress: str = "none"  # gradient compression of the dp reduction (plait.compression)

    def __post_init__(self) -> None:
        for name in (
            "dp",
            "tp",
            "pp",
            "num_microbatches",
            "micro_batch_size",
            "num_chunks",
            "seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r} is unknown; use {RECOMPUTE_MODES}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r} is unknown; use 'adam' or 'sgd'")
        check_rank_order(self.rank_order)
        check_ep(self.ep, self.dp, self.tp)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "compress", str(parse_compression(self.compress)))
        check_zero(self.compress, self.zero_stage)

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """The replicas of each expert: dp × tp / ep (`plait.layout`)."""
        return self.dp * self.tp // self.ep

    @property
    def num_stages(self) -> int:
        """Pipeline stages, virtual ones included: pp × num_chunks."""
        return self.pp * self.num_chunks

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all data-parallel ranks."""
        return self.dp * self.num_microbatches * self.micro_batch_size

    def global_rank(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> int:
        """The global rank of a (pipeline, data, tensor) coordinate under `rank_order`, as
        the runtime mesh places it (`plait.mesh.ParallelDims.rank_grid`)."""
        degrees = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        return global_rank(self.rank_order, degrees, {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank})

    def tp_group(self, pp_rank: int, dp_rank: int = 0) -> list[int]:
        return [self.global_rank(pp_rank, dp_rank, t) for t in range(self.tp)]

    def dp_group(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        return [self.global_rank(pp_rank, d, tp_rank) for d in range(self.dp)]

    def ep_group(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> list[int]:
        """The ranks exchanging tokens with (pp_rank, dp_rank, tp_rank): ep neighbouring
        (dp, tp) indices, tp innermost (`plait.layout.expert_index`)."""
        flat = dp_rank * self.tp + tp_rank  # dp × tp, tp innermost (plait.layout)
        first = flat - flat % self.ep
        return [self._flat_rank(pp_rank, first + e) for e in range(self.ep)]

    def expert_dp_group(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> list[int]:
        """The ranks holding the same experts as (pp_rank, dp_rank, tp_rank)."""
        offset = (dp_rank * self.tp + tp_rank) % self.ep
        return [self._flat_rank(pp_rank, f) for f in range(offset, self.dp * self.tp, self.ep)]

    def _flat_rank(self, pp_rank: int, flat: int) -> int:
        """The global rank of index `flat` of the dp × tp ranks (tp innermost)."""
        return self.global_rank(pp_rank, *divmod(flat, self.tp))
