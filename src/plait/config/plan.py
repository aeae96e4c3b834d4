"""The parallel plan: how one model is spread over its workers, the union of the sections
of `plait.config.sections` (layout, pipeline, memory, numerics, communication), checked
before any worker starts."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from plait.compression import check_zero
from plait.config.fields import check_types
from plait.config.sections import (
    SECTIONS,
    CommunicationSection,
    LayoutSection,
    MemorySection,
    NumericsSection,
    PipelineSection,
)
from plait.config.specs import DP_AXES, DTYPES, Recompute, layout_of, pipeline_specs
from plait.layout import Layout, resolve_dp
from plait.pipelines import check_hetero_plan
from plait.schedule.registry import schedule_kind

__all__ = ["ParallelPlan"]


@dataclass(frozen=True, kw_only=True)
class ParallelPlan(
    CommunicationSection, NumericsSection, MemorySection, PipelineSection, LayoutSection
):
    """How one model is spread over its workers: the union of the five sections of
    `plait.config.sections` (layout, pipeline, memory, numerics, communication), whose
    fields it inherits, checked each by its section and then across sections here.

    `partition` gives the blocks per (virtual) stage; None splits them equally (or lets
    the engine balance them by the profile).
    """

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", pipeline_specs(self.pipelines))
        check_types(self)
        for section in SECTIONS.values():
            section._check_section(self)
        dp, _, _, zero = resolve_dp(self.dp, self.dp_replicate, self.dp_shard, self.zero)
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "zero", zero)
        self._check_across()
        layout = self.layout  # checks ep against the layout's axes
        if layout.dp_replicate > 1 and layout.dp_shard > 1 and self.ep > 1:
            raise ValueError(
                f"ep={self.ep} with dp_replicate={layout.dp_replicate} × dp_shard="
                f"{layout.dp_shard}: experts are sharded over their own replicas, which hybrid "
                "sharding does not lay out yet; use dp_replicate=1 (zero=3) or ep=1"
            )
        self._check_trainable()

    def section(self, name: str) -> Any:
        """The section `name` of this plan (`plait.config.sections.SECTIONS`) as a value,
        e.g. `plan.section("memory").zero`."""
        if name not in SECTIONS:
            raise ValueError(f"section {name!r} is unknown; choose one of {list(SECTIONS)}")
        cls = SECTIONS[name]
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def sections(self) -> dict[str, Any]:
        """Every section of this plan, by name, in the order files list them."""
        return {name: self.section(name) for name in SECTIONS}

    def _check_across(self) -> None:
        """What makes any plan well formed, trained or only simulated, that one section
        cannot tell alone."""
        self._check_recompute_stages()
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1: set tp or drop sequence_parallel")
        check_zero(self.compress, self.zero)
        if self.partition is not None and (
            len(self.partition) != self.num_stages or min(self.partition) < 1
        ):
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
