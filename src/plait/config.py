"""Frozen, validated configuration of a training run, built from TOML and/or flags."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelConfig", "PipelineConfig", "TrainConfig", "load_config"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The reference GPT's shape; the vocabulary comes from the data."""

    name: str = "gpt"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_len: int = 64
    ffn_hidden: int | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.name != "gpt":
            raise ValueError(f"model name={self.name!r} is unknown; available: 'gpt'")
        _positive(self, "layers", "hidden", "heads", "seq_len")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not a multiple of heads={self.heads}: change one of them"
            )


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline degree and schedule."""

    pp: int = 2
    schedule: str = "1f1b"
    microbatches: int = 4
    chunks: int = 1

    def __post_init__(self) -> None:
        _positive(self, "pp", "microbatches", "chunks")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is unknown; choose one of {SCHEDULES}")
        if self.schedule == "interleaved" and self.chunks < 2:
            raise ValueError("schedule='interleaved' needs chunks >= 2 (virtual stages per rank)")
        if self.schedule != "interleaved" and self.chunks != 1:
            raise ValueError(f"chunks={self.chunks} applies only to schedule='interleaved'")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    nproc: int = 2
    max_steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    log_every: int = 10
    sample_chars: int = 200
    run_dir: str | None = None

    def __post_init__(self) -> None:
        _positive(self, "nproc", "max_steps", "batch_size", "log_every")
        if self.nproc != self.pipeline.pp:
            raise ValueError(
                f"nproc={self.nproc} workers but pp={self.pipeline.pp}: set --nproc equal to --pp"
            )
        stages = self.pipeline.pp * self.pipeline.chunks
        if stages > self.model.layers + 2:
            raise ValueError(
                f"pp × chunks = {stages} stages exceed the model's {self.model.layers + 2} blocks "
                f"(embedding, {self.model.layers} layers, head): use more layers or fewer stages"
            )
        if self.batch_size % self.pipeline.microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by microbatches="
                f"{self.pipeline.microbatches}: use a multiple"
            )
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type[Any]] = {"model": ModelConfig, "pipeline": PipelineConfig}


def _build(cls: type[Any], values: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in {where}; known: {sorted(known)}")
    return cls(**values)


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """A `TrainConfig` from a TOML file (sections [model] and [pipeline], the rest top level)
    with `overrides` applied on top; keys named `model.x` / `pipeline.x` go to sections."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    sections: dict[str, dict[str, Any]] = {k: dict(data.pop(k, {})) for k in _SECTIONS}
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        if section:
            sections[section][name] = value
        else:
            data[key] = value
    built = {k: _build(cls, sections[k], f"[{k}]") for k, cls in _SECTIONS.items()}
    result: TrainConfig = _build(TrainConfig, {**data, **built}, "the top level")
    return result
