"""A run's configuration from a TOML file or a run's `config.json`, and overrides."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from plait.config.model import ModelConfig
from plait.config.plan import ParallelPlan
from plait.config.sections import OLD_TABLE, from_file, section_of
from plait.config.train import TrainConfig

__all__ = ["config_from_dict", "load_config", "read_config_file"]

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
    """The settings in a TOML file, or in a JSON one (a run's `config.json`), by suffix,
    with the plan's sections ([layout], [pipeline], [memory], [numerics],
    [communication]; or the flat [parallel] of older files) as one flat `parallel` table."""
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
    plan, data = from_file(data, f"config file {path}")
    stray = [k for k in data if section_of(k) is not None]
    if stray:  # a plan file's top-level keys: in a run's settings they belong to a section
        raise ValueError(
            f"config file {path}: {stray[0]} is a {section_of(stray[0])} setting: put it "
            f"under [{section_of(stray[0])}]"
        )
    if plan:  # the sections' settings, as the flat table the config's `parallel` takes
        data[OLD_TABLE] = plan
    for key, value in data.items():  # `plan = ""` would read as no plan given at all
        if value == "":
            raise ValueError(f"config file {path}: {key}='' is empty: give a value or drop it")
    return data


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """A `TrainConfig` from a TOML file ([model], the plan's sections of
    `plait.config.sections`, the rest top level) or a run's `config.json`, with
    `overrides` applied on top; keys named `model.x` / `parallel.x` go to the model and
    the plan. A setting that would have no effect in the run warns."""
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


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """The `TrainConfig` whose `to_dict()` is `data` (what the launcher hands each worker)."""
    return TrainConfig(
        **{k: v for k, v in data.items() if k not in ("model", "parallel")},
        model=ModelConfig(**data["model"]),
        parallel=ParallelPlan(**data["parallel"]),
    )
