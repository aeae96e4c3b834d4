"""`plait.train.run`: train one's own model on one's own data from Python, on local
workers launched as `plait train` launches them."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import TrainConfig, load_config
from plait.config.sections import to_file
from plait.train.launch import launch
from plait.train.slowdown import check_config
from plait.train.task import CustomTask, MetricFn

__all__ = ["run"]


def run(
    model: nn.Module | Callable[[], nn.Module],
    dataset: Any,
    config: TrainConfig | dict[str, Any] | None = None,
    *,
    loss: Callable[..., torch.Tensor] = F.cross_entropy,
    metrics: dict[str, MetricFn] | None = None,
    validation: Any = None,
    max_restarts: int | None = None,
) -> dict[str, Any]:
    """Train `model` on `dataset` under `config` on `config.nproc` local workers; returns
    the run's summary (as `plait train` writes to summary.json).

    - `model`: an `nn.Module` whose blocks can be cut into stages (an `nn.Sequential`, or
      a module with a `blocks()` method returning its layers in order), or a function
      building one. Every worker starts from the same weights: a module is sent to each
      as it is; a function is called after `torch.manual_seed(config.seed)`.
    - `dataset`: a map-style `torch.utils.data.Dataset` of (input, target) pairs, a pair
      of tensors (inputs, targets) indexed along dim 0, or an object with
      `batch(step, batch_size)`. Step `s` trains on `batch_size` samples drawn with a
      generator seeded by (seed, s): the same on every rank and after a resume.
    - `config`: a `TrainConfig`, or a dict of `load_config` overrides
      (`{"parallel.dp": 2, "max_steps": 100}`); its `model` shape fields are ignored.
    - `loss(output, target)`: a mean over the micro-batch (default cross-entropy).
    - `metrics`: {name: fn(output, target) -> number of correct samples (a sum)},
      averaged over `validation` (same kinds as `dataset`, read in order) after training
      into the summary's `validation`.

    Workers are spawned processes, so `model` (or its function), `dataset`, `loss` and
    `metrics` must pickle: module-level functions and classes, not lambdas. Call `run`
    under `if __name__ == "__main__":` in a script.
    """
    cfg = _config(config)
    run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    data = cfg.to_dict()
    (run_dir / "config.json").write_text(json.dumps(to_file(data), indent=2))
    custom = CustomTask(model, dataset, loss, metrics, validation)
    from plait.train.start import train_worker

    restarts = cfg.max_restarts if max_restarts is None else max_restarts
    results = launch(train_worker, int(cfg.nproc or 1), data, str(run_dir), custom,
                     max_restarts=restarts)  # fmt: skip
    summary: dict[str, Any] = next(s for s in results.values() if s is not None)
    return summary


def _config(config: TrainConfig | dict[str, Any] | None) -> TrainConfig:
    if isinstance(config, TrainConfig):
        cfg = config
    else:
        overrides = {k: v for k, v in (config or {}).items() if k != "model.name"}
        cfg = load_config(**overrides, **{"model.name": "custom"})
    if cfg.plan == "auto":
        raise ValueError(
            "plan='auto' is not available for plait.train.run yet: give the layout "
            "(parallel.dp, parallel.pp, ...)"
        )
    check_config(cfg)  # the --cluster file, read before any worker starts
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="custom"))
