"""Frozen, validated configuration of a training run, built from TOML and/or flags."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import tomllib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.compression import check_zero, parse_compression
from plait.dataspec import DATA_FORMS, parse_data
from plait.layout import RANK_ORDERS, Layout, check_rank_order, resolve_dp
from plait.offload import check_offload_blocks, normalize_offload
from plait.pipelines import check_hetero_plan
from plait.pretrained import read_pretrained
from plait.schedule.registry import KINDS, schedule_kind

__all__ = [
    "DATA",
    "MODELS",
    "OPTIMIZER_IMPLS",
    "ModelConfig",
    "ParallelPlan",
    "PipelineSpec",
    "TrainConfig",
    "load_config",
    "read_config_file",
]

MODELS = {
    "gpt": "plait's reference GPT",
    "resnet18": "ResNet-18 for small images",
    "hf-gpt2": "Hugging Face GPT-2 from a config or --init-from, needs plait[hf]",
    "hf-llama": "Hugging Face Llama from a config or --init-from, needs plait[hf]",
    "moe-gpt": "plait's GPT with mixture-of-experts feed-forward layers",
    "custom": "a model given to plait.train.run (Python only)",
    "MODULE:FACTORY": "your own model: FACTORY(vocab_size=, seq_len=) in MODULE (a module "
    "name or a .py file) returns it; see examples/my_model.py",
}
DATA = DATA_FORMS
#: `--device` values (`plait.device.DEVICE_KINDS`, which checks them against the host)
DEVICES = ("auto", "cpu", "cuda")
#: `--optimizer-impl` values (`plait.train.optim.implementation` chooses for `auto`)
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop")
_IMAGE_DATA = ("digits", "cifar100", "synthetic")


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    # resolved once per class: the annotations are strings under `from __future__`
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join("unset" if a is type(None) else _describe(a) for a in args)
    if typing.get_origin(hint) is tuple:
        item = args[0]
        if typing.get_origin(item) is typing.Literal:
            return f"a list, each of {list(typing.get_args(item))}"
        return "a list of integers"
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {list(args)}"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


_PLAIN = (int, str, bool)
# (origin, args) of each hint met: typing computes them anew on every call, and the planner
# builds tens of thousands of plans
_SHAPES: dict[Any, tuple[Any, tuple[Any, ...]]] = {}


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(ok, value converted to `hint`): ints widen to floats, lists become tuples; nothing
    else converts (a bool is not an integer here, a string is not a number)."""
    if type(value) is hint and hint in _PLAIN:  # the common case, without typing's walk
        return True, value
    shape = _SHAPES.get(hint)
    if shape is None:
        shape = _SHAPES[hint] = (typing.get_origin(hint), typing.get_args(hint))
    origin, args = shape
    if origin in (types.UnionType, typing.Union):
        for arg in args:
            ok, out = (value is None, None) if arg is type(None) else _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return False, value
        items = [_coerce(v, args[0]) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if origin is typing.Literal:
        return value in args, value
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number, float(value) if number else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value  # a hint this checker does not know: the field validates itself


def _check_types(obj: Any) -> None:
    """Every field of the dataclass `obj` holds its declared type, or a ValueError names
    the field, the value and the type it should have (TOML, JSON and the API alike)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, converted = _coerce(value, hints[f.name])
        if not ok:
            raise ValueError(
                f"{f.name}={value!r} must be {_describe(hints[f.name])}, not {type(value).__name__}"
            )
        if isinstance(converted, float) and not math.isfinite(converted):
            raise ValueError(f"{f.name}={value!r} must be a finite number")
        if converted == "":  # an empty flag or TOML string is a slip, never a choice
            raise ValueError(f"{f.name}='' is empty: give a value, or leave {f.name} unset")
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The reference GPT's shape; the vocabulary comes from the data."""

    name: str = field(
        default="gpt",
        metadata={
            "help": "model: " + "; ".join(f"{k} ({v})" for k, v in MODELS.items()),
            "flag": "--model",
            "metavar": "NAME|MODULE:FACTORY",
        },
    )
    layers: int = field(default=4, metadata={"help": "transformer layers"})
    hidden: int = field(default=128, metadata={"help": "hidden size"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    seq_len: int = field(default=64, metadata={"help": "tokens per sample"})
    ffn_hidden: int | None = field(
        default=None, metadata={"help": "MLP width", "default_text": "4 × hidden"}
    )
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    width: int = field(
        default=16, metadata={"help": "resnet18: channels of its first stage (64 in the paper)"}
    )
    experts: int = field(default=4, metadata={"help": "moe-gpt: experts per MoE layer"})
    top_k: int = field(
        default=2, metadata={"help": "moe-gpt: experts per token (1: Switch, 2: GShard)"}
    )
    capacity_factor: float = field(
        default=1.25,
        metadata={
            "help": "moe-gpt: expert capacity = factor · tokens · top_k / experts; 0: dropless"
        },
    )
    moe_every: int = field(
        default=2, metadata={"help": "moe-gpt: every k-th layer is a MoE layer, others dense"}
    )
    shared_expert: bool = field(
        default=False, metadata={"help": "moe-gpt: a dense FFN every token also passes through"}
    )
    aux_loss_coef: float = field(
        default=0.01, metadata={"help": "moe-gpt: weight of the load-balancing loss"}
    )
    z_loss_coef: float = field(
        default=0.001, metadata={"help": "moe-gpt: weight of the router z-loss"}
    )

    def __post_init__(self) -> None:
        _check_types(self)
        module, sep, factory = self.name.rpartition(":")
        user = bool(sep and module and factory.isidentifier())  # a MODULE:FACTORY model
        if self.name not in MODELS and not user:
            raise ValueError(
                f"model name={self.name!r} is unknown; choose one of {list(MODELS)[:-1]}, "
                "or give your own as MODULE:FACTORY (e.g. examples/my_model.py:build)"
            )
        _positive(self, "layers", "hidden", "heads", "seq_len", "width")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ValueError(
                f"ffn_hidden={self.ffn_hidden} must be a positive integer, or unset (4 × hidden)"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must lie in [0, 1) (a probability)")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not a multiple of heads={self.heads}: change one of them"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        _positive(self, "experts", "top_k", "moe_every")
        if self.name == "moe-gpt" and self.top_k > self.experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds experts={self.experts}: use top_k <= experts"
            )
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name}={value} must be a finite number >= 0")
        if self.name == "moe-gpt" and self.moe_every > self.layers:
            raise ValueError(
                f"moe_every={self.moe_every} with layers={self.layers} leaves no MoE layer: "
                "use moe_every <= layers"
            )

    @property
    def num_blocks(self) -> int:
        """Pipeline blocks: ResNet-18's ten, or embedding, `layers` layers and head."""
        return 10 if self.name == "resnet18" else self.layers + 2

    @property
    def is_language_model(self) -> bool:
        """Trains on token sequences (a user's MODULE:FACTORY model does too)."""
        return self.name not in ("resnet18", "custom")

    @property
    def is_user_model(self) -> bool:
        """A MODULE:FACTORY model from the command line."""
        return ":" in self.name

    @property
    def known_blocks(self) -> bool:
        """Whether `num_blocks` is known before the model is built (not a user's model)."""
        return self.name != "custom" and not self.is_user_model


# the ModelConfig fields each model never reads (a custom model comes built: not checked)
_MOE = ("experts", "top_k", "capacity_factor", "moe_every", "shared_expert", "aux_loss_coef",
        "z_loss_coef")  # fmt: skip
_MODEL_UNUSED = {
    "gpt": ("width", *_MOE), "hf-gpt2": ("width", *_MOE), "hf-llama": ("width", *_MOE),
    "resnet18": ("layers", "hidden", "heads", "seq_len", "ffn_hidden", "dropout", *_MOE),
    "moe-gpt": ("width",),
}  # fmt: skip


def _warn_unused(obj: Any, names: tuple[str, ...], why: str) -> None:
    """Warn about each of `names` set to other than its default: it has no effect (`why`)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in names and f.default is not dataclasses.MISSING and value != f.default:
            warnings.warn(f"{f.name}={value!r} has no effect {why}: drop it", stacklevel=3)


def _adopt_pretrained(model: ModelConfig, path: str) -> ModelConfig:
    """`model` with the family and shape of the Hugging Face folder at `path`: a field set
    to other than its default that differs from the folder's is an error."""
    shape = read_pretrained(path)
    defaults = ModelConfig()
    for name, value in shape.model_fields().items():
        mine = getattr(model, name)
        if mine != value and mine != getattr(defaults, name):
            flag = "--model" if name == "name" else "--" + name.replace("_", "-")
            raise ValueError(
                f"{name}={mine!r} contradicts init_from={path!r}, whose config.json gives "
                f"{value!r}: drop {flag} (the folder decides the model's shape)"
            )
    if model.seq_len > shape.max_positions:
        raise ValueError(
            f"seq_len={model.seq_len} exceeds the {shape.max_positions} positions of "
            f"init_from={path!r}: use seq_len <= {shape.max_positions}"
        )
    return dataclasses.replace(model, **shape.model_fields())


Recompute = typing.Literal["none", "selective", "full"]
RECOMPUTE = typing.get_args(Recompute)
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """One pipeline (HetPipe's virtual worker) of a heterogeneous plan: its blocks per
    stage (pp = len(partition) / chunks ranks), its micro-batches per step (its share of
    the batch) and the device kind of each rank (informative)."""

    partition: tuple[int, ...]
    microbatches: int
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_types(self)
        _positive(self, "microbatches")
        if not self.partition or min(self.partition) < 1:
            raise ValueError(
                f"pipelines: partition={list(self.partition)} must give >= 1 block to each stage"
            )


def _pipeline_specs(value: Any) -> Any:
    """`pipelines` as read from TOML/JSON (a list of objects) -> PipelineSpecs."""
    if value is None or not isinstance(value, list | tuple):
        return value
    if not all(isinstance(v, dict | PipelineSpec) for v in value):
        raise ValueError(
            f"pipelines={value!r} must be a list of objects, each with partition and microbatches"
        )
    try:
        return tuple(v if isinstance(v, PipelineSpec) else PipelineSpec(**v) for v in value)
    except TypeError as err:
        raise ValueError(f"pipelines={value!r}: {err}") from None


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
        object.__setattr__(self, "pipelines", _pipeline_specs(self.pipelines))
        _check_types(self)
        _positive(self, "dp")
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
        _positive(self, "dp", "cp", "tp", "pp", "microbatches", "chunks", "wsp_wave")
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
        unset = {k for k in _DP_AXES if out[k] is None} | ({"cp"} if self.cp == 1 else set())
        if self.recompute_stages is None:  # files read as before the field existed
            unset.add("recompute_stages")
        return {k: v for k, v in out.items() if k not in unset}

    @property
    def layout(self) -> Layout:
        """The named-axis layout of the ranks (`plait.layout.Layout`)."""
        return _layout_of(self.pp, self.dp, self.dp_replicate, self.dp_shard, self.zero,
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


_DP_AXES = ("dp_replicate", "dp_shard")


@functools.lru_cache(maxsize=256)
def _layout_of(
    pp: int,
    dp: int,
    rep: int | None,
    shard: int | None,
    zero: int,
    cp: int,
    tp: int,
    ep: int,
    order: str,
) -> Layout:
    """A plan's layout, built once per distinct plan (the simulator asks for it per rank)."""
    _, replicate, sharded, _ = resolve_dp(dp, rep, shard, zero)
    return Layout(pp=pp, dp_replicate=replicate, dp_shard=sharded, cp=cp, tp=tp, ep=ep,
                  rank_order=order)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"group": "model"})
    parallel: ParallelPlan = field(default_factory=ParallelPlan, metadata={"group": "layout"})
    nproc: int | None = field(
        default=None,
        metadata={
            "group": "layout",
            "help": "local worker processes",
            "default_text": "dp × tp × pp",
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "group": "layout",
            "help": "where workers compute: auto (one GPU each when the host has GPUs, else "
            "CPU workers), cpu, or cuda",
            "choices": DEVICES,
        },
    )
    deterministic: bool = field(
        default=False,
        metadata={
            "group": "numerics",
            "help": "repeatable kernels, bit for bit from run to run "
            "(torch.use_deterministic_algorithms; slower on GPUs)",
        },
    )
    cluster: str | None = field(
        default=None,
        metadata={
            "group": "layout",
            "help": "cluster file or preset: rank r runs as slow as its device r's "
            "slowdown (plait.train.slowdown)",
        },
    )
    max_steps: int = field(default=300, metadata={"group": "optimizer", "help": "optimizer steps"})
    batch_size: int = field(
        default=32, metadata={"group": "data", "help": "samples per step (global batch)"}
    )
    lr: float = field(default=3e-3, metadata={"group": "optimizer", "help": "peak learning rate"})
    weight_decay: float = field(
        default=0.01,
        metadata={
            "group": "optimizer",
            "help": "weight decay (not applied to biases and norm weights)",
        },
    )
    optimizer: str = field(
        default="adamw",
        metadata={"group": "optimizer", "help": "optimizer", "choices": ("adamw", "sgd")},
    )
    beta1: float = field(
        default=0.9, metadata={"group": "optimizer", "help": "AdamW's first-moment decay"}
    )
    beta2: float = field(
        default=0.999, metadata={"group": "optimizer", "help": "AdamW's second-moment decay"}
    )
    eps: float = field(default=1e-8, metadata={"group": "optimizer", "help": "AdamW's epsilon"})
    momentum: float = field(default=0.0, metadata={"group": "optimizer", "help": "SGD's momentum"})
    nesterov: bool = field(
        default=False, metadata={"group": "optimizer", "help": "SGD with Nesterov momentum"}
    )
    optimizer_impl: str = field(
        default="auto",
        metadata={
            "group": "numerics",
            "help": "torch's optimizer kernels: fused, foreach or a loop per parameter; auto: "
            "fused where torch has them (CUDA, CPU), else foreach (CUDA) or a loop (CPU)",
            "choices": OPTIMIZER_IMPLS,
        },
    )
    tf32: bool = field(
        default=False,
        metadata={
            "group": "numerics",
            "help": "fp32 matmuls and convolutions in TF32 on CUDA GPUs",
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "group": "numerics",
            "help": "torch.compile each block of each stage (plait.train.compile)",
        },
    )
    lr_schedule: str = field(
        default="constant",
        metadata={
            "group": "optimizer",
            "help": "after warm-up: constant, or cosine or linear decay to min_lr",
            "choices": ("constant", "cosine", "linear"),
        },
    )
    warmup_steps: int = field(
        default=0,
        metadata={
            "group": "optimizer",
            "help": "steps of linear learning-rate warm-up from lr/(n+1)",
        },
    )
    min_lr: float = field(
        default=0.0,
        metadata={"group": "optimizer", "help": "learning rate at the last step (cosine, linear)"},
    )
    eval_every: int | None = field(
        default=None,
        metadata={
            "group": "evaluation",
            "help": "validation loss every N steps (always at the end)",
        },
    )
    eval_batches: int = field(
        default=4,
        metadata={
            "group": "evaluation",
            "help": "validation batches (of batch_size) per evaluation during the run (the one "
            "after the last step reads the whole split); 0: none",
        },
    )
    grad_clip: float | None = field(
        default=1.0,
        metadata={
            "group": "optimizer",
            "help": "clip the global gradient norm to this value; 0: no clipping",
        },
    )
    plan: str | None = field(
        default=None,
        metadata={
            "group": "layout",
            "help": "'auto': profile, plan and train; or a plan file from `plait plan --out` "
            "(its model and layout are adopted)",
            "metavar": "auto|FILE",
            "default_text": "auto when no layout is given",
        },
    )
    allow_staleness: bool = field(
        default=False,
        metadata={
            "group": "layout",
            "help": "let --plan auto choose an asynchronous schedule (stale weights)",
        },
    )
    replan: bool = field(
        default=False,
        metadata={
            "group": "layout",
            "help": "with --plan auto: measure and decide again, replacing the decision kept "
            "for these flags on this host (which --dry-run shows and a run reuses)",
        },
    )
    seed: int = field(
        default=0, metadata={"group": "data", "help": "seed of the model and the data order"}
    )
    log_every: int = field(
        default=10,
        metadata={"group": "logging", "help": "flush metrics.jsonl every N steps", "metavar": "N"},
    )
    sample_chars: int = field(
        default=200,
        metadata={"group": "evaluation", "help": "characters of text sampled after training"},
    )
    run_dir: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "output folder",
            "metavar": "DIR",
            "default_text": "a new runs/<time>",
        },
    )
    checkpoint_every: int | None = field(
        default=None,
        metadata={
            "group": "checkpoints",
            "help": "save a checkpoint every N steps (in the background) under RUN_DIR/checkpoints",
            "metavar": "N",
        },
    )
    checkpoint_start: bool = field(
        default=False,
        metadata={
            "group": "checkpoints",
            "help": "also save a checkpoint of step 0, before the first step (the initial "
            "weights; a run resumed from it trains as one that was never stopped)",
        },
    )
    flush_every: int | None = field(
        default=None,
        metadata={
            "group": "pipeline",
            "help": "asynchronous schedules: finish every micro-batch in flight and start a "
            "new stream every N steps; their checkpoints are saved at these flushes, so a run "
            "with --checkpoint-every (a multiple of N) trains exactly as the same run without",
            "metavar": "N",
        },
    )
    keep: int | None = field(
        default=3,
        metadata={
            "group": "checkpoints",
            "help": "keep the newest K published checkpoints, deleting older ones (never the "
            "newest, nor one being written); 0 or unset (API): keep every one",
            "metavar": "K",
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "group": "checkpoints",
            "help": "resume from the newest good checkpoint of --run-dir ('auto') or a "
            "checkpoint folder; any layout loads any checkpoint",
            "metavar": "auto|PATH",
        },
    )
    max_restarts: int = field(
        default=0,
        metadata={
            "group": "checkpoints",
            "help": "restart the workers up to R times after one dies, resuming from the "
            "newest good checkpoint (needs --checkpoint-every)",
            "metavar": "R",
        },
    )
    timeout_s: float = field(
        default=300.0,
        metadata={
            "group": "communication",
            "help": "longest wait for another worker before the run fails naming it",
            "flag": "--timeout",
            "metavar": "SECONDS",
        },
    )
    verbosity: int = field(
        default=0,
        metadata={
            "group": "logging",
            "help": "-1 warnings and the final summary only, 0 progress lines, 1 debug details too",
            "choices": (-1, 0, 1),
        },
    )
    log_all_ranks: bool = field(
        default=False,
        metadata={
            "group": "logging",
            "help": "every worker logs (default: rank 0; others warn only)",
        },
    )
    tensorboard: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "also write TensorBoard scalars to this folder (extra 'tensorboard')",
        },
    )
    trace_steps: int = field(
        default=2,
        metadata={
            "group": "logging",
            "help": "the last N steps drawn into trace.json and timeline.png",
        },
    )
    profile_steps: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "A:B records a torch.profiler trace of steps A to B-1 per rank (steps "
            "count from 0, as in metrics.jsonl)",
        },
    )
    data: str = field(
        default="stdlib",
        metadata={
            "group": "data",
            "help": "data: " + "; ".join(f"{k} ({v})" for k, v in DATA.items()),
            "metavar": "KIND[:PATH]",
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "group": "data",
            "help": "a tokenizer.json (Hugging Face tokenizers), or a folder holding one, for "
            "text data; the vocabulary comes from it",
            "metavar": "PATH",
            "default_text": "--init-from's tokenizer.json if it has one, else characters",
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "group": "model",
            "help": "start from the weights of a local Hugging Face model folder (config.json "
            "+ safetensors; GPT-2 or Llama family); the model and its shape come from it",
            "metavar": "DIR",
        },
    )
    wandb: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "also log to Weights & Biases under this project (extra 'wandb'; "
            "WANDB_MODE=offline keeps it local)",
            "metavar": "PROJECT",
        },
    )

    repartition: str = field(
        default="off",
        metadata={
            "group": "pipeline",
            "help": "move blocks between pipeline ranks while training when stage times "
            "drift apart (plait.train.repartition)",
            "choices": ("off", "auto"),
        },
    )
    repartition_threshold: float = field(
        default=0.2,
        metadata={
            "group": "pipeline",
            "help": "re-partition when the slowest stage exceeds the fastest by this",
        },
    )
    repartition_patience: int = field(
        default=3,
        metadata={
            "group": "pipeline",
            "help": "steps in a row over the threshold before re-partitioning",
        },
    )

    def __post_init__(self) -> None:
        _check_types(self)
        if self.init_from is not None:
            object.__setattr__(self, "model", _adopt_pretrained(self.model, self.init_from))
        par = self.parallel
        self._check_repartition()
        if self.nproc is None:
            object.__setattr__(self, "nproc", par.world_size)
        _positive(self, "nproc", "max_steps", "batch_size", "log_every", "trace_steps")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is unknown: use one of {list(DEVICES)}")
        self._check_fault_tolerance()
        self._check_logging()
        self._check_data()
        if self.nproc != par.world_size:
            raise ValueError(
                f"nproc={self.nproc} workers but dp × tp × pp = {par.dp} × {par.tp} × {par.pp} = "
                f"{par.world_size}: make them equal"
            )
        blocks = self.model.num_blocks
        if self.model.known_blocks and par.num_stages > blocks:
            what = (
                f"(embedding, {self.model.layers} layers, head): use more layers or fewer stages"
                if self.model.is_language_model
                else "(stem, 8 residual blocks, head): use fewer stages"
            )
            raise ValueError(
                f"pp × chunks = {par.num_stages} stages exceed the model's {blocks} blocks {what}"
            )
        if self.model.known_blocks:
            check_offload_blocks(par.offload_activations, blocks)
        if self.model.known_blocks and par.partition and sum(par.partition) != blocks:
            raise ValueError(f"partition={list(par.partition)} must add up to {blocks} blocks")
        every, wave = self.checkpoint_every, par.wsp_wave
        if par.wsp_staleness is not None and every is not None and every % wave:
            raise ValueError(
                f"checkpoint_every={every} is not a multiple of wsp_wave={wave}: a WSP "
                f"checkpoint is saved at a wave's end; use --checkpoint-every "
                f"{every - every % wave or wave}"
            )
        if par.pipelines is not None:
            sizes = [list(p.partition) for p in par.pipelines]
            if self.model.known_blocks and sum(sizes[0]) != blocks:
                raise ValueError(f"pipelines: partitions {sizes} must add up to {blocks} blocks")
        if self.batch_size % par.step_microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by dp × microbatches = "
                f"{par.step_microbatches}: use a multiple"
            )
        if par.ep > 1 and self.model.name != "moe-gpt":
            raise ValueError(
                f"ep={par.ep} with model {self.model.name!r}: expert parallelism spreads the "
                "experts of a mixture-of-experts model; use --model moe-gpt or ep=1"
            )
        if par.tp > 1 and self.model.name == "resnet18":
            raise ValueError(
                f"tp={par.tp} with model {self.model.name!r}: its layers have no "
                "tensor-parallel plan in plait yet; use tp=1 (dp and pp work)"
            )
        if par.sequence_parallel and self.model.name in ("hf-gpt2", "hf-llama", "moe-gpt"):
            raise ValueError(
                f"sequence_parallel with model {self.model.name!r}: its tensor-parallel plan "
                "keeps whole sequences on every rank; drop sequence_parallel"
            )
        kv_heads = self.model.heads // 2 if self.model.heads % 2 == 0 else self.model.heads
        if self.init_from is not None:
            kv_heads = read_pretrained(self.init_from).kv_heads
        if self.model.name == "hf-llama" and kv_heads % par.tp:
            raise ValueError(
                f"tp={par.tp} must divide hf-llama's {kv_heads} key-value heads: use a tp "
                "that divides them"
            )
        if self.model.heads % par.tp or self.model.hidden % par.tp:
            raise ValueError(
                f"tp={par.tp} must divide heads={self.model.heads} and hidden={self.model.hidden}"
            )
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise ValueError(
                f"grad_clip={self.grad_clip} must be positive, or 0 (or None) for no clipping"
            )
        if self.grad_clip == 0:  # the flag's and TOML's way to say "none"
            object.__setattr__(self, "grad_clip", None)
        self._check_optimizer()
        if self.sample_chars < 0:
            raise ValueError(f"sample_chars={self.sample_chars} must be 0 or more (0: no sample)")
        self._check_paths()

    def _check_repartition(self) -> None:
        if self.repartition not in ("off", "auto"):
            raise ValueError(f"repartition={self.repartition!r} must be 'off' or 'auto'")
        if not self.repartition_threshold > 0 or not math.isfinite(self.repartition_threshold):
            raise ValueError(
                f"repartition_threshold={self.repartition_threshold} must be a positive number "
                "(0.2: the slowest stage 20% slower than the fastest)"
            )
        _positive(self, "repartition_patience")
        par = self.parallel
        if self.repartition == "auto" and (
            par.pp == 1 or par.dp > 1 or par.tp > 1 or not schedule_kind(par.schedule).synchronous
        ):
            raise ValueError(
                f"repartition='auto' needs a synchronous pipeline (pp > 1) without data or "
                f"tensor parallelism; got pp={par.pp}, dp={par.dp}, tp={par.tp}, schedule="
                f"{par.schedule!r}: use repartition='off' or such a layout"
            )

    def _check_optimizer(self) -> None:
        for name in ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "min_lr"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name}={value} must be a finite number")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if self.weight_decay < 0 or self.momentum < 0 or not self.eps > 0:
            raise ValueError(
                f"weight_decay={self.weight_decay}, momentum={self.momentum} must be >= 0 and "
                f"eps={self.eps} positive"
            )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1={self.beta1}, beta2={self.beta2} must lie in [0, 1)")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r} is unknown: use 'adamw' or 'sgd'")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"optimizer_impl={self.optimizer_impl!r} is unknown: use one of "
                f"{list(OPTIMIZER_IMPLS)}"
            )
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum > 0):
            raise ValueError("nesterov=true needs optimizer='sgd' and momentum > 0")
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} is unknown: use constant, cosine or linear"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr} must lie in [0, lr={self.lr}]")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be 0 or more")
        if self.eval_every is not None and (
            not isinstance(self.eval_every, int) or self.eval_every < 1
        ):
            raise ValueError(f"eval_every={self.eval_every!r} must be a positive integer, or unset")
        if not isinstance(self.eval_batches, int) or self.eval_batches < 0:
            raise ValueError(f"eval_batches={self.eval_batches!r} must be 0 or more")

    def _check_data(self) -> None:
        """The data exists in kind, and fits the model (tokens for language models, labelled
        images for ResNet); the packages its reading needs are installed."""
        if self.model.name == "custom":  # the data came with the model (plait.train.run)
            return
        if self.data == "cifar100":
            raise ValueError(
                "data='cifar100' needs the folder of the extracted python release: "
                "data='cifar100:PATH'"
            )
        spec = parse_data(self.data)
        language = self.model.is_language_model
        if not (spec.is_language if language else spec.kind in _IMAGE_DATA):
            what = "token sequences" if language else "labelled images"
            fits = [
                k for k in DATA if k == "synthetic" or (k.split(":")[0] in _IMAGE_DATA) != language
            ]
            raise ValueError(
                f"model {self.model.name!r} cannot train on data={self.data!r}: it needs "
                f"{what}; use data= one of {fits}"
            )
        needs = [("digits", spec.kind == "digits", "sklearn", "data"),
                 ("hf-disk", spec.kind == "hf-disk", "datasets", "datasets"),
                 ("tokenizer", self.tokenizer is not None, "tokenizers", "hf"),
                 (self.model.name, self.model.name.startswith("hf-"), "transformers", "hf"),
                 ("wandb", self.wandb is not None, "wandb", "wandb")]  # fmt: skip
        for what, needed, package, extra in needs:
            if needed and importlib.util.find_spec(package) is None:
                raise ValueError(
                    f"{what} needs the {package} package, which is not installed: "
                    f"pip install 'plait[{extra}]'"
                )
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise ValueError(
                f"tokenizer={self.tokenizer!r} does not exist: give a tokenizer.json or a "
                "folder holding one"
            )

    def _check_fault_tolerance(self) -> None:
        every, keep = self.checkpoint_every, self.keep
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"checkpoint_every={every!r} must be a positive integer, or unset")
        if keep is not None and (not isinstance(keep, int) or keep < 0):
            raise ValueError(f"keep={keep!r} must be a positive integer, or 0 to keep every one")
        flush = self.flush_every
        if flush is not None and (not isinstance(flush, int) or flush < 1):
            raise ValueError(f"flush_every={flush!r} must be a positive integer, or unset")
        self._check_flushes()
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r} must be 0 or more")
        if self.max_restarts and self.checkpoint_every is None:
            raise ValueError(
                f"max_restarts={self.max_restarts} without checkpoint_every: a restarted run "
                "would start again from step 0; set checkpoint_every (--checkpoint-every N)"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive (seconds)")

    def _check_logging(self) -> None:
        if self.verbosity not in (-1, 0, 1):
            raise ValueError(f"verbosity={self.verbosity!r} must be -1 (quiet), 0 or 1 (verbose)")
        if self.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                f"tensorboard={self.tensorboard!r} needs the tensorboard package, which is not "
                "installed: pip install 'plait[tensorboard]', or drop the option"
            )
        if self.profile_steps is not None:
            first, sep, last = self.profile_steps.partition(":")
            if not (sep and first.isdigit() and last.isdigit() and int(first) < int(last)):
                raise ValueError(
                    f"profile_steps={self.profile_steps!r} must read A:B with A < B (steps A "
                    "to B-1), e.g. '5:7'"
                )
            if int(last) > self.max_steps:
                raise ValueError(
                    f"profile_steps={self.profile_steps!r} ends after max_steps="
                    f"{self.max_steps}: profile steps below {self.max_steps}"
                )

    def _check_paths(self) -> None:
        """A checkpoint to resume from exists; a TensorBoard folder is not a file."""
        if self.resume not in (None, "auto") and not Path(self.resume).is_dir():
            raise ValueError(
                f"resume={self.resume!r}: no such checkpoint folder; give a checkpoint "
                "(RUN_DIR/checkpoints/step-NNNNNNNN) or 'auto' with run_dir"
            )
        if self.tensorboard is not None and Path(self.tensorboard).is_file():
            raise ValueError(f"tensorboard={self.tensorboard!r} is a file: give a folder")

    def _check_flushes(self) -> None:
        """An asynchronous stream is saved where it flushes (nothing in flight): saves fall
        on flushes, and the flushes do not depend on whether the run saves."""
        every, flush = self.checkpoint_every, self.flush_every
        stale = not schedule_kind(self.parallel.schedule).synchronous or (
            self.plan == "auto" and self.allow_staleness
        )
        if not stale or every is None:
            return
        kind = "plan='auto' with allow_staleness" if self.plan == "auto" else (
            f"schedule={self.parallel.schedule!r}"
        )  # fmt: skip
        if flush is None:
            raise ValueError(
                f"checkpoint_every={every} with {kind}: an asynchronous stream is saved where it "
                f"flushes, so the flushes must not depend on the saves; add flush_every "
                f"(--flush-every {every}, or a divisor of {every}) and give the same to a run "
                "without checkpoints that should train the same"
            )
        if every % flush:
            raise ValueError(
                f"checkpoint_every={every} is not a multiple of flush_every={flush}: an "
                f"asynchronous stream is saved where it flushes; use --checkpoint-every "
                f"{every - every % flush or flush} or a flush_every dividing {every}"
            )

    def _warn_unused(self) -> None:
        """Settings accepted but read by nothing in this run warn, naming what would use them.
        Called where a config is made from the user's input (`load_config`), not on every
        copy: workers rebuilding the launcher's config would repeat each warning."""
        model = self.model.name
        _warn_unused(self.model, _MODEL_UNUSED.get(model, ()), f"with model {model!r}")
        samples = (  # see train.task: a sample of the character-level model
            self.model.known_blocks
            and self.model.is_language_model
            and self.data == "stdlib"
            and self.tokenizer is None
        )
        for names, idle, why in (
            (("momentum",), self.optimizer == "adamw", "with optimizer='adamw' (SGD's)"),
            (("beta1", "beta2", "eps"), self.optimizer == "sgd", "with optimizer='sgd' (AdamW's)"),
            (("min_lr",), self.lr_schedule == "constant", "with lr_schedule='constant'"),
            (("keep",), self.checkpoint_every is None, "without checkpoint_every (no saves)"),
            (
                ("flush_every",),
                self.plan != "auto" and schedule_kind(self.parallel.schedule).synchronous,
                "with a synchronous schedule (nothing is in flight between steps)",
            ),
            (("eval_every",), self.eval_batches == 0, "with eval_batches=0 (no validation)"),
            (("allow_staleness",), self.plan != "auto", "unless plan='auto' (the planner's)"),
            (("replan",), self.plan != "auto", "unless plan='auto' (nothing is decided)"),
            (("sample_chars",), not samples, "unless a language model trains on data='stdlib'"),
            (
                ("repartition_threshold", "repartition_patience"),
                self.repartition == "off",
                "with repartition='off'",
            ),
        ):
            if idle:
                _warn_unused(self, names, why)
        if self.resume == "auto" and self.run_dir is None:
            warnings.warn(
                "resume='auto' without run_dir: a new run folder holds no checkpoint to resume; "
                "set run_dir to the run to continue",
                stacklevel=3,
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type[Any]] = {"model": ModelConfig, "parallel": ParallelPlan}


def _table(values: Any, where: str) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a table of settings, not {values!r}")
    return values


def _build(cls: type[Any], values: Any, where: str) -> Any:
    _table(values, where)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in {where}; known: {sorted(known)}")
    try:
        return cls(**values)
    except ValueError as err:
        raise ValueError(f"{err} (in {where})") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings in a TOML file, or in a JSON one (a run's `config.json`), by suffix."""
    if not str(path).strip():  # Path("") would be the working directory
        raise ValueError("config file '' is an empty path: give a TOML file or a run's config.json")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"config file {path} is not a file (a TOML or a run's config.json)")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as err:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ValueError(f"config file {path} is not valid {kind}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold an object of settings")
    for key, value in data.items():  # `plan = ""` would read as no plan given at all
        if value == "":
            raise ValueError(f"config file {path}: {key}='' is empty: give a value or drop it")
    return data


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """A `TrainConfig` from a TOML file (sections [model] and [parallel], the rest top level)
    or a run's `config.json`, with `overrides` applied on top; keys named `model.x` /
    `parallel.x` go to sections. A setting that would have no effect in the run warns."""
    data: dict[str, Any] = read_config_file(path) if path is not None else {}
    sections: dict[str, Any] = {k: data.pop(k, {}) for k in _SECTIONS}
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        if section:
            sections[section] = {**_table(sections[section], f"[{section}]"), name: value}
        else:
            data[key] = value
    built = {k: _build(cls, sections[k], f"[{k}]") for k, cls in _SECTIONS.items()}
    result: TrainConfig = _build(TrainConfig, {**data, **built}, "the top level")
    result._warn_unused()
    return result
