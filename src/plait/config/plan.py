"""The parallel plan: how one model is spread over its workers (layout, pipeline, memory,
numerics and communication options), checked before any worker starts."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from plait.compression import check_zero, parse_compression
from plait.config.fields import check_types, positive
from plait.config.specs import (
    DP_AXES,
    DTYPES,
    RECOMPUTE,
    PipelineSpec,
    Recompute,
    layout_of,
    pipeline_specs,
)
from plait.layout import RANK_ORDERS, Layout, check_rank_order, resolve_dp
from plait.offload import normalize_offload
from plait.pipelines import check_hetero_plan
from plait.schedule.registry import KINDS, schedule_kind

__all__ = ["ParallelPlan"]


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """How one model is spread over dp × tp × pp workers, and with which memory options.

    `partition` gives the blocks per (virtual) stage; None splits them equally (or lets
    the engine balance them by the profile).
    """

    dp: int = field(
        default=1,
        metadata={"help": "data-parallel degree (dp_replicate × dp_shard when those are given)"},
    )
    dp_replicate: int | None = field(
        default=None,
        metadata={
            "help": "data-parallel replicas that all-reduce gradients (with dp_shard > 1: "
            "HSDP, sharding inside a replica group)",
            "default_text": "dp, or 1 under zero=3",
        },
    )
    dp_shard: int | None = field(
        default=None,
        metadata={
            "help": "data-parallel ranks that shard parameters with FSDP2 (> 1 implies zero=3 "
            "unless zero=2)",
            "default_text": "1, or dp under zero=3",
        },
    )
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree"})
    cp: int = field(
        default=1,
        metadata={
            "help": "context-parallel degree: the sequence is split over cp ranks (zigzag "
            "chunks) and attention runs as a ring (plait.parallel.context)"
        },
    )
    pp: int = field(
        default=2,
        metadata={"help": "pipeline degree (with --nproc and no --pp: nproc / (dp × cp × tp))"},
    )
    schedule: str = field(
        default="1f1b",
        metadata={
            "group": "pipeline",
            "help": "pipeline schedule: "
            + "; ".join(f"{k.name} ({k.summary})" for k in KINDS.values()),
            "choices": tuple(KINDS),
        },
    )
    microbatches: int = field(
        default=4,
        metadata={"group": "pipeline", "help": "micro-batches per step and data-parallel replica"},
    )
    chunks: int = field(
        default=1,
        metadata={"group": "pipeline", "help": "virtual stages per rank (interleaved: 2 or more)"},
    )
    zero: int = field(
        default=0,
        metadata={
            "group": "memory",
            "help": "ZeRO stage of data parallelism (2 and 3 through FSDP2)",
            "choices": (0, 1, 2, 3),
        },
    )
    recompute: Recompute = field(
        default="none",
        metadata={
            "group": "memory",
            "help": "activation recomputation",
            "choices": ("none", "selective", "full"),
        },
    )
    recompute_stages: tuple[Recompute, ...] | None = field(
        default=None,
        metadata={
            "group": "memory",
            "help": "recomputation of each (virtual) stage, first to last, e.g. full,none: "
            "1F1B's first stages hold the most micro-batches; instead of recompute",
            "default_text": "recompute on every stage",
        },
    )
    sequence_parallel: bool = field(
        default=False,
        metadata={"group": "memory", "help": "shard activations along the sequence (needs tp > 1)"},
    )
    dtype: str = field(
        default="fp32",
        metadata={
            "group": "numerics",
            "help": "training dtype",
            "choices": ("fp32", "bf16", "fp16"),
        },
    )
    partition: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "group": "pipeline",
            "help": "blocks per (virtual) stage, e.g. 2,2,2",
            "default_text": "balanced",
        },
    )
    ep: int = field(
        default=1,
        metadata={
            "help": "expert-parallel degree: experts spread over ep of the dp × tp ranks "
            "(must divide dp × tp; not sharded by tp; needs a model with experts)"
        },
    )
    rank_order: str = field(
        default="tp-dp-pp",
        metadata={
            "help": "how global ranks are laid out over the axes, innermost first",
            "choices": RANK_ORDERS,
        },
    )
    compress: str = field(
        default="none",
        metadata={
            "group": "communication",
            "help": "gradient compression of the data-parallel reduction: none, fp16, bf16, "
            "powersgd:RANK, threshold:TAU, topk:RATIO, sign or dgc:RATIO (Deep Gradient "
            "Compression, e.g. dgc:0.001 or dgc:1000x; ZeRO-2/3: fp16, bf16 only)",
            "metavar": "METHOD",
        },
    )
    # a heterogeneous plan (`plait plan` on a mixed cluster writes it): see plait.train.hetero
    pipelines: tuple[PipelineSpec, ...] | None = field(
        default=None,
        metadata={"help": "per-pipeline partitions and micro-batches (plan files)", "flag": None},
    )
    wsp_staleness: int | None = field(
        default=None,
        metadata={
            "group": "pipeline",
            "help": "Wave Synchronous Parallel: replicas push their updates once per wave and "
            "run exactly this many waves ahead of the others' (0: every wave); unset: "
            "synchronous gradient averaging",
            "metavar": "D",
        },
    )
    wsp_wave: int = field(
        default=1,
        metadata={
            "group": "pipeline",
            "help": "WSP: optimizer steps per wave (pushes every N steps)",
        },
    )
    wsp_at_most: bool = field(
        default=False,
        metadata={
            "group": "pipeline",
            "help": "WSP: take in others' waves once reduced, waiting only beyond D "
            "(staleness at most D; nondeterministic)",
        },
    )

    offload_activations: str = field(
        default="none",
        metadata={
            "group": "memory",
            "help": "swap the activations blocks save for backward to host memory during "
            "forward, back in backward (vDNN): none, all, or block indices e.g. 1,2",
            "metavar": "BLOCKS",
        },
    )
    offload_optimizer: bool = field(
        default=False,
        metadata={
            "group": "memory",
            "help": "keep optimizer state in host memory outside the optimizer step",
        },
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", pipeline_specs(self.pipelines))
        check_types(self)
        positive(self, "dp")
        dp, _, _, zero = resolve_dp(self.dp, self.dp_replicate, self.dp_shard, self.zero)
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "zero", zero)
        self._check_layout()
        layout = self.layout  # checks ep against the layout's axes
        if layout.dp_replicate > 1 and layout.dp_shard > 1 and self.ep > 1:
            raise ValueError(
                f"ep={self.ep} with dp_replicate={layout.dp_replicate} × dp_shard="
                f"{layout.dp_shard}: experts are sharded over their own replicas, which hybrid "
                "sharding does not lay out yet; use dp_replicate=1 (zero=3) or ep=1"
            )
        self._check_trainable()

    def _check_layout(self) -> None:
        """What makes any layout well formed, trained or only simulated."""
        positive(self, "dp", "cp", "tp", "pp", "microbatches", "chunks", "wsp_wave")
        object.__setattr__(self, "offload_activations", normalize_offload(self.offload_activations))
        if self.wsp_staleness is not None and self.wsp_staleness < 0:
            raise ValueError(
                f"wsp_staleness={self.wsp_staleness} must be >= 0 waves (0: push every wave)"
            )
        if self.wsp_at_most and self.wsp_staleness is None:
            raise ValueError(
                "wsp_at_most bounds WSP's staleness: set wsp_staleness too, or drop it"
            )
        if self.schedule not in KINDS:
            raise ValueError(f"schedule={self.schedule!r} is unknown; choose one of {list(KINDS)}")
        schedule_kind(self.schedule).chunks(self.chunks)
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r} must be 0, 1, 2 or 3 (ZeRO stage)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")
        self._check_recompute_stages()
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1: set tp or drop sequence_parallel")
        object.__setattr__(self, "compress", str(parse_compression(self.compress)))
        check_zero(self.compress, self.zero)
        check_rank_order(self.rank_order)
        if self.partition is not None:
            object.__setattr__(self, "partition", tuple(self.partition))
            if len(self.partition) != self.num_stages or min(self.partition) < 1:
                raise ValueError(
                    f"partition={list(self.partition)} must give >= 1 block to each of the "
                    f"{self.num_stages} stages (pp × chunks)"
                )

    def _check_trainable(self) -> None:
        """What the runtime cannot apply (or what does nothing when trained): refused here,
        before any worker starts. The simulator's plan (`plait.sim.SimPlan`) skips these,
        as it prices layouts training does not run (tf32, fp8, asynchronous with tp)."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if self.zero and self.dp == 1:
            raise ValueError(
                f"zero={self.zero} with dp=1 does nothing (ZeRO shards over data-parallel "
                "replicas): set dp > 1 or zero=0"
            )
        if self.microbatches < self.pp:
            warnings.warn(
                f"microbatches={self.microbatches} is fewer than pp={self.pp} stages: some "
                f"stages idle all step; use at least {self.pp} micro-batches",
                stacklevel=4,
            )
        self._check_asynchronous()
        self._check_compression()
        if self.pipelines is not None or self.wsp_staleness is not None:
            if self.cp > 1:
                raise ValueError(
                    f"cp={self.cp} with pipelines of their own (pipelines or wsp_staleness) "
                    "is not supported: use cp=1, or one pipeline layout"
                )
            check_hetero_plan(self)

    def _check_compression(self) -> None:
        if self.compress != "none" and self.dp == 1:
            raise ValueError(
                f"compress={self.compress} with dp=1: there is no data-parallel reduction to "
                "compress; set dp > 1 or drop compress"
            )

    def _check_asynchronous(self) -> None:
        why = schedule_kind(self.schedule).unsupported(tp=self.tp, zero=self.zero, dtype=self.dtype)
        if why is not None:
            raise ValueError(f"schedule={self.schedule!r} {why}")

    @property
    def world_size(self) -> int:
        if self.pipelines is not None:
            return sum(len(p.partition) // self.chunks for p in self.pipelines)
        return self.dp * self.cp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def recompute_of(self, stage: int) -> Recompute:
        """The recomputation of (virtual) stage `stage`."""
        return self.recompute if self.recompute_stages is None else self.recompute_stages[stage]

    def _check_recompute_stages(self) -> None:
        given = self.recompute_stages
        if given is None:
            return
        if self.recompute != "none":
            raise ValueError(
                f"recompute={self.recompute!r} with recompute_stages={list(given)}: give one "
                "mode for every stage (recompute) or one per stage (recompute_stages)"
            )
        if self.pipelines is not None:
            raise ValueError(
                "recompute_stages with pipelines: each pipeline has its own stages; give "
                "recompute for all of them"
            )
        if len(given) != self.num_stages:
            raise ValueError(
                f"recompute_stages={list(given)} gives {len(given)} modes for "
                f"{self.num_stages} stages (pp × chunks): give one per stage"
            )

    def to_dict(self) -> dict[str, Any]:
        """Every field, less the data-parallel axes when unset (dp and zero say it all),
        so that files and outputs of plans without them read as before the axes existed."""
        out = dataclasses.asdict(self)
        unset = {k for k in DP_AXES if out[k] is None} | ({"cp"} if self.cp == 1 else set())
        if self.recompute_stages is None:  # files read as before the field existed
            unset.add("recompute_stages")
        return {k: v for k, v in out.items() if k not in unset}

    @property
    def layout(self) -> Layout:
        """The named-axis layout of the ranks (`plait.layout.Layout`)."""
        return layout_of(self.pp, self.dp, self.dp_replicate, self.dp_shard, self.zero,
                          self.cp, self.tp, self.ep, self.rank_order)  # fmt: skip

    def _rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return self.layout.global_rank({"pp": pp_rank, "dp": dp_rank, "tp": tp_rank})

    def global_rank(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> int:
        """The global rank of a (pipeline, data, tensor) coordinate under `rank_order`, as
        the runtime mesh places it (`plait.layout.Layout.global_rank`)."""
        return self._rank(pp_rank, dp_rank, tp_rank)

    def tp_group(self, pp_rank: int, dp_rank: int = 0) -> list[int]:
        return self.layout.ranks("tp", self._rank(pp_rank, dp_rank, 0))

    def dp_group(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        return self.layout.ranks("dp", self._rank(pp_rank, 0, tp_rank))

    @property
    def edp(self) -> int:
        """The replicas of each expert: dp × tp / ep (`plait.layout.Layout`)."""
        return self.layout.degree("edp")

    def ep_group(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> list[int]:
        """The ranks exchanging tokens with (pp_rank, dp_rank, tp_rank): ep neighbouring
        (dp, tp) indices, tp innermost (`plait.layout.Layout`)."""
        return self.layout.ranks("ep", self._rank(pp_rank, dp_rank, tp_rank))

    def expert_dp_group(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> list[int]:
        """The ranks holding the same experts as (pp_rank, dp_rank, tp_rank)."""
        return self.layout.ranks("edp", self._rank(pp_rank, dp_rank, tp_rank))

    @property
    def step_microbatches(self) -> int:
        """Micro-batches of one step over all replicas (each pipeline's own with pipelines)."""
        if self.pipelines is not None:
            return sum(p.microbatches for p in self.pipelines)
        return self.dp * self.microbatches
