"""Validation during training: the loss over held-out batches, on every worker, through
the same pipeline as training (`Engine.evaluate`, forward only).

A periodic evaluation (`eval_every`) reads the first `eval_batches` of the task's
validation split, in order, so every evaluation of a run (and of a resumed run) sees the
same samples; the one after the last step reads the whole split, and its figures are the
run's `validation` in summary.json. A classifier's metrics (accuracy) come with the loss.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from plait.config import TrainConfig
from plait.train.engine import Engine, StepReport
from plait.train.task import Task

__all__ = ["Validation", "due", "summarise", "validate"]


@dataclass(frozen=True)
class Validation:
    """One evaluation's outcome: the mean loss (and metrics) over its batches after `step`."""

    step: int
    loss: float
    samples: int
    drained: list[StepReport]  # an asynchronous stream's drains, to log as updates
    metrics: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """Its fields in the metrics row of its step."""
        extra = {f"val_{k}": v for k, v in self.metrics.items()}
        return {"val_loss": self.loss, "val_samples": self.samples, **extra}


def due(cfg: TrainConfig, done: int) -> bool:
    """Whether to evaluate after `done` steps: every `eval_every` and after the last (never
    when `eval_batches` is 0)."""
    if cfg.eval_batches == 0:
        return False
    every = cfg.eval_every
    return done == cfg.max_steps or (every is not None and done % every == 0)


def validate(
    engine: Engine, task: Task, cfg: TrainConfig, step: int, *, whole: bool = False
) -> Validation | None:
    """The validation loss after step `step` over the first `eval_batches` batches, or the
    `whole` split (a collective: every worker calls it); None when the task has no
    validation split."""
    if task.validation is None:
        return None
    total = samples = 0.0
    sums = dict.fromkeys(task.metrics, 0.0)
    drained = []
    batches = task.validation()
    for batch in batches if whole else itertools.islice(batches, cfg.eval_batches):
        report = engine.evaluate(batch, cast(dict[str, Any], task.metrics) or None)
        total += report.loss * report.samples
        samples += report.samples
        for name, value in report.metrics.items():
            sums[name] += value * report.samples
        if report.drained is not None:
            drained.append(report.drained)
    if samples == 0:
        return None
    metrics = {k: v / samples for k, v in sums.items()}
    return Validation(step, total / samples, int(samples), drained, metrics)


def summarise(run_dir: Path, summary: dict[str, Any], last: Validation | None) -> None:
    """Add the last validation to the run's summary (and its summary.json): `val_loss`,
    `val_step`, and `validation` with the loss, each metric and the samples it covered."""
    if last is None:
        return
    summary["val_loss"], summary["val_step"] = last.loss, last.step
    summary["validation"] = {"loss": last.loss, **last.metrics, "samples": last.samples}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
