"""Frozen, validated configuration of a training run, built from TOML and/or flags.

A run's `TrainConfig` holds two sections of their own, the model (`ModelConfig`) and the
parallel plan (`ParallelPlan`, which the planner, plan files and the simulator share), and
the run's other settings. The modules: `fields` (type checks every section shares),
`model`, `specs` (recomputation modes, dtypes, one pipeline of a heterogeneous plan),
`plan`, `train` and its checks (`train_checks`), and `load` (TOML and `config.json`).
"""

from __future__ import annotations

from plait.config.load import config_from_dict, load_config, read_config_file
from plait.config.model import MODELS, ModelConfig
from plait.config.plan import ParallelPlan
from plait.config.specs import DTYPES, RECOMPUTE, PipelineSpec, Recompute
from plait.config.train import TrainConfig
from plait.config.train_checks import DATA, DEVICES, OPTIMIZER_IMPLS

__all__ = [
    "DATA",
    "DEVICES",
    "DTYPES",
    "MODELS",
    "OPTIMIZER_IMPLS",
    "RECOMPUTE",
    "ModelConfig",
    "ParallelPlan",
    "PipelineSpec",
    "Recompute",
    "TrainConfig",
    "config_from_dict",
    "load_config",
    "read_config_file",
]
