"""Validation during training: the loss over a fixed set of held-out batches, on every worker.

The batches are the corpus's validation split, drawn by index 0..eval_batches-1 with the
run's seed, so every evaluation of a run (and of a resumed run) sees the same samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.config import TrainConfig
from plait.train.engine import Engine, StepReport

__all__ = ["Validation", "due", "summarise", "validate"]


@dataclass(frozen=True)
class Validation:
    """One evaluation's outcome: the mean loss over its batches after step `step`."""

    step: int
    loss: float
    samples: int
    drained: list[StepReport]  # an asynchronous stream's drains, to log as updates

    def row(self) -> dict[str, Any]:
        """Its fields in the metrics row of its step."""
        return {"val_loss": self.loss, "val_samples": self.samples}


def due(cfg: TrainConfig, done: int) -> bool:
    """Whether to evaluate after `done` steps: every `eval_every` and after the last (never
    when `eval_batches` is 0)."""
    if cfg.eval_batches == 0:
        return False
    every = cfg.eval_every
    return done == cfg.max_steps or (every is not None and done % every == 0)


def validate(engine: Engine, corpus: Any, cfg: TrainConfig, step: int) -> Validation:
    """The validation loss after step `step` (a collective: every worker calls it)."""
    total = samples = 0.0
    drained = []
    for index in range(cfg.eval_batches):
        batch = corpus.batch(
            index, cfg.batch_size, cfg.model.seq_len, seed=cfg.seed, split="validation"
        )
        report = engine.evaluate(batch)
        total += report.loss * report.samples
        samples += report.samples
        if report.drained is not None:
            drained.append(report.drained)
    return Validation(step, total / samples, int(samples), drained)


def summarise(run_dir: Path, summary: dict[str, Any], last: Validation | None) -> None:
    """Add the last validation loss to the run's summary (and its summary.json)."""
    if last is None:
        return
    summary["val_loss"], summary["val_step"] = last.loss, last.step
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
