"""The function the launcher starts in each worker, named without importing the training
loop: the launcher process passes it by name, and importing `plait.train.loop` there (the
runtime, DCP) cost it 1.9 s of CPU while its workers started on the same cores."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.train.task import CustomTask

__all__ = ["train_worker"]


def train_worker(
    cfg_data: dict[str, Any], run_dir: str, custom: CustomTask | None = None
) -> dict[str, Any] | None:
    """`plait.train.loop.train_worker`, imported in the worker."""
    from plait.train.loop import train_worker as run

    return run(cfg_data, run_dir, custom)
