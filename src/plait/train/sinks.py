"""Where a run's scalars go besides metrics.jsonl: TensorBoard (`tensorboard = DIR`) and
Weights & Biases (`wandb = PROJECT`), each optional, each fed the same values under the
same step (0-based, as metrics.jsonl).

W&B runs under its own settings from the environment (`WANDB_MODE=offline` keeps the run
on disk, `wandb sync` uploads it later; `WANDB_API_KEY`, `WANDB_ENTITY`); its files go under
the run folder (`RUN_DIR/wandb/`), its run is named after the run folder, and a resumed run
(`--resume`) continues the same W&B run (its id is derived from the run folder).
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Sink", "TensorBoardSink", "WandbSink", "open_sinks"]


class Sink(Protocol):
    """Scalars of a step, and the run's summary at its end."""

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, summary: Mapping[str, Any] | None = None) -> None: ...


class TensorBoardSink:
    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=folder)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        wandb: Any = importlib.import_module("wandb")
        ident = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=project, name=run_dir.name, dir=str(run_dir), config=config, id=ident,
            resume="allow", settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        if summary is not None:
            numbers = {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
            self.run.summary.update(numbers)
        self.run.finish()


def open_sinks(
    *, tensorboard: str | None, wandb: str | None, run_dir: Path, config: dict[str, Any]
) -> list[Sink]:
    """The sinks a run's settings ask for (none by default)."""
    sinks: list[Sink] = []
    if tensorboard is not None:
        sinks.append(TensorBoardSink(tensorboard))
    if wandb is not None:
        sinks.append(WandbSink(wandb, run_dir, config))
    return sinks
