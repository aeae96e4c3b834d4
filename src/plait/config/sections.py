"""The parallel plan's five sections: layout, pipeline, memory, numerics, communication.

Each section is a frozen dataclass of its own fields (their help, choices and defaults)
and of the checks that need only them (`_check_section`). `ParallelPlan` is their union:
it inherits every section's fields, so a plan stays one flat frozen dataclass. That is
deliberate: the planner builds tens of thousands of plans per search (with
`dataclasses.replace`, and the simulator's `SimPlan` adds its batch fields to them), and
nested sections would multiply those objects and every `replace` by five. A plan gives
each section as a value (`ParallelPlan.section`), and the files (TOML, a run's
`config.json`, plan files) hold the sections as tables of their own: `to_file` writes
them, `from_file` reads them, and reads the flat `[parallel]` table that files written
before the sections hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from plait.compression import parse_compression
from plait.config.fields import check_types, positive
from plait.config.specs import RECOMPUTE, PipelineSpec, Recompute, pipeline_specs
from plait.layout import RANK_ORDERS, check_rank_order
from plait.offload import normalize_offload
from plait.schedule.registry import KINDS, schedule_kind

__all__ = [
    "OLD_TABLE",
    "SECTIONS",
    "CommunicationSection",
    "LayoutSection",
    "MemorySection",
    "NumericsSection",
    "PipelineSection",
    "flat_plan_file",
    "from_file",
    "section_of",
    "to_file",
]


class _Section:
    """What every section does: its own checks at construction (a section built alone,
    e.g. `MemorySection(zero=5)`, is refused as the plan would refuse it)."""

    def __post_init__(self) -> None:
        check_types(self)
        type(self)._check_section(self)

    def _check_section(self) -> None:
        """The checks that need only this section's fields (none by default)."""


@dataclass(frozen=True, kw_only=True)
class LayoutSection(_Section):
    """How many workers each axis of the layout takes, and their rank order."""

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

    def _check_section(self) -> None:
        positive(self, "dp", "cp", "tp", "pp")
        check_rank_order(self.rank_order)


@dataclass(frozen=True, kw_only=True)
class PipelineSection(_Section):
    """The schedule and its micro-batches, the stage cut, per-pipeline plans and WSP."""

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
    partition: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "group": "pipeline",
            "help": "blocks per (virtual) stage, e.g. 2,2,2",
            "default_text": "balanced",
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", pipeline_specs(self.pipelines))
        super().__post_init__()

    def _check_section(self) -> None:
        positive(self, "microbatches", "chunks", "wsp_wave")
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
        if self.partition is not None:
            object.__setattr__(self, "partition", tuple(self.partition))


@dataclass(frozen=True, kw_only=True)
class MemorySection(_Section):
    """What saves memory: ZeRO, recomputation, sequence parallelism, offloading."""

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

    def _check_section(self) -> None:
        object.__setattr__(self, "offload_activations", normalize_offload(self.offload_activations))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r} must be 0, 1, 2 or 3 (ZeRO stage)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")


@dataclass(frozen=True, kw_only=True)
class NumericsSection(_Section):
    """The number format of training (what training runs is checked by the plan: the
    simulator also prices tf32 and fp8)."""

    dtype: str = field(
        default="fp32",
        metadata={
            "group": "numerics",
            "help": "training dtype",
            "choices": ("fp32", "bf16", "fp16"),
        },
    )


@dataclass(frozen=True, kw_only=True)
class CommunicationSection(_Section):
    """How the workers' gradients travel."""

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

    def _check_section(self) -> None:
        object.__setattr__(self, "compress", str(parse_compression(self.compress)))


#: section name (a table in files) -> its dataclass, in the order files list them
SECTIONS: dict[str, Any] = {
    "layout": LayoutSection,
    "pipeline": PipelineSection,
    "memory": MemorySection,
    "numerics": NumericsSection,
    "communication": CommunicationSection,
}
_OWNER = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}
# the flat table that files written before the sections hold
OLD_TABLE = "parallel"


def section_of(name: str) -> str | None:
    """The section a plan field belongs to (None: no plan field)."""
    return _OWNER.get(name)


def to_file(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (a plan file's keys, or a run's settings with the plan under `parallel`)
    as files write them: `model` first, then each plan field in its section's table, then
    the other keys as they are."""
    values = dict(values)
    flat = values.pop(OLD_TABLE, None)
    plan = dict(flat) if isinstance(flat, dict) else {}
    for key in [k for k in values if k in _OWNER]:
        plan[key] = values.pop(key)
    tables: dict[str, Any] = {name: {} for name in SECTIONS}
    for key, value in plan.items():
        tables[_OWNER[key]][key] = value
    head = {"model": values.pop("model")} if "model" in values else {}
    return {**head, **{k: v for k, v in tables.items() if v}, **values}


def from_file(
    data: dict[str, Any], where: str = "the file"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the plan's fields, flat; every other key) of a file's settings: its section
    tables, or the flat `[parallel]` table of a file written before the sections. A key
    under the wrong section, or one set twice, is refused naming where it belongs."""
    rest = dict(data)
    plan: dict[str, Any] = {}
    where_set: dict[str, str] = {}
    tables = [(name, rest.pop(name)) for name in (*SECTIONS, OLD_TABLE) if name in rest]
    for name, table in tables:
        if not isinstance(table, dict):
            raise ValueError(f"[{name}] must be a table of settings in {where}, not {table!r}")
        for key, value in table.items():
            owner = _OWNER.get(key)
            if name != OLD_TABLE and owner is not None and owner != name:
                raise ValueError(
                    f"{key} in [{name}] of {where} is a {owner} setting: move it to [{owner}]"
                )
            if name != OLD_TABLE and owner is None:
                known = sorted(f.name for f in fields(SECTIONS[name]))
                raise ValueError(f"unknown key {key!r} in [{name}] of {where}; known: {known}")
            if key in plan:
                raise ValueError(
                    f"{key} is set twice in {where}, in [{where_set[key]}] and in [{name}]: "
                    "keep one"
                )
            plan[key], where_set[key] = value, name
    return plan, rest


def flat_plan_file(data: dict[str, Any], where: str = "the plan file") -> dict[str, Any]:
    """A plan file's keys with the plan's fields flat beside the others (the batch, the
    prediction, the model), from the sections or from a file written before them."""
    plan, rest = from_file(data, where)
    clash = sorted(set(plan) & set(rest))
    if clash:
        raise ValueError(f"{clash[0]} is set twice in {where}, in a section and at the top")
    return {**rest, **plan}
