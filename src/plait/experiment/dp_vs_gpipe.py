"""Data parallelism against a GPipe pipeline on ResNet-18, seed 001's Tables 3 and 4, as
one experiment: measured on this machine's workers, beside the simulator's prediction at the
paper's scale (`plait.experiment.dp_vs_gpipe_predict`, whose names this module re-exports).

Seed 001 (§4) trained a CIFAR ResNet-18 on CIFAR-100 for 10 epochs on 2, 4, 6 and 8 A100s,
once with Horovod data parallelism and once with torchgpipe, in fp32 and in fp16; the
GPipe runs took 4-20× the data-parallel times.

Measured here: `plait.train.run` trains the same ResNet-18 (narrower, on fewer images, on
CPU worker processes) with dp = workers and with pp = workers under the `gpipe` schedule,
the stages cut by `plait.plan.partition` from block times measured by `plait.profile`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from plait.experiment.dp_vs_gpipe_predict import (
    METHODS,
    PUBLISHED,
    PaperSetup,
    implied_task_s,
    predict,
    predict_cell,
)

__all__ = ["PUBLISHED", "DpGpipeConfig", "PaperSetup", "implied_task_s", "measure",
           "measure_cell", "predict", "predict_cell", "run_experiment"]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DpGpipeConfig:
    """What to measure on this machine (a reduced size, stated in the report)."""

    workers: tuple[int, ...] = (2, 4)
    dtypes: tuple[str, ...] = ("fp32",)
    epochs: int = 1
    data: str = "synthetic"  # or "cifar100:PATH"
    train_images: int = 2048
    val_images: int = 512
    batch_size: int = 64
    microbatches: int = 4
    width: int = 16  # the paper's ResNet-18 has 64
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "train_images", "val_images", "batch_size", "microbatches",
                     "width"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.workers or min(self.workers) < 1 or max(self.workers) > 10:
            raise ValueError(f"workers={list(self.workers)}: give counts from 1 to 10 "
                             "(ResNet-18 has 10 blocks to cut into stages)")  # fmt: skip
        for dtype in self.dtypes:
            if dtype not in ("fp32", "fp16", "bf16"):
                raise ValueError(f"dtype {dtype!r}: use fp32, fp16 or bf16")
        if self.data != "synthetic" and not self.data.startswith("cifar100:"):
            raise ValueError(f"data={self.data!r}: use 'synthetic' or 'cifar100:PATH'")
        for w in self.workers:
            if self.batch_size % w:
                raise ValueError(f"batch_size={self.batch_size} is not divisible by workers={w}")
        if self.batch_size % self.microbatches:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by "
                             f"microbatches={self.microbatches}")  # fmt: skip

    @property
    def steps(self) -> int:
        return self.epochs * math.ceil(self.train_images / self.batch_size)


# ------------------------------------------------------------------ measurement
def _data(config: DpGpipeConfig) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
    if config.data == "synthetic":
        from plait.data.synthetic import SyntheticClassification

        total = config.train_images + config.val_images
        data = SyntheticClassification((3, 32, 32), 100, size=total, seed=config.seed)
        images, labels = data.sample(torch.arange(total))
        train = (images[: config.train_images], labels[: config.train_images])
        return train, (images[config.train_images :], labels[config.train_images :])
    from plait.data.images import cifar100

    c = cifar100(config.data.split(":", 1)[1])
    train = (c.train_images[: config.train_images], c.train_labels[: config.train_images])
    return train, (c.val_images[: config.val_images], c.val_labels[: config.val_images])


def _model_factory(width: int) -> Callable[[], torch.nn.Module]:
    from functools import partial

    from plait.models.resnet import ResNet18

    return partial(ResNet18, width=width, num_classes=100)


def _partition(config: DpGpipeConfig, workers: int, sample: torch.Tensor) -> tuple[int, ...]:
    """Blocks per stage, balanced by block times measured here (torchgpipe's balance by
    time), for one micro-batch."""
    from plait.plan.partition import partition
    from plait.profile.measure import profile_blocks

    torch.manual_seed(config.seed)
    model = _model_factory(config.width)()
    blocks: list[torch.nn.Module] = list(model.blocks())  # type: ignore[operator]
    profiles = profile_blocks(blocks, sample, warmup=1, repeats=3)
    return partition([p.forward_s + p.backward_s for p in profiles], workers).sizes


def measure_cell(config: DpGpipeConfig, method: str, workers: int, dtype: str,
                 run_dir: Path) -> dict[str, Any]:  # fmt: skip
    """Train once on this machine; seconds are the training steps' (worker start-up and
    validation excluded), accuracy the validation top-1 after training."""
    from plait.train import run
    from plait.train.task import accuracy

    train, val = _data(config)
    overrides: dict[str, Any] = {
        "nproc": workers, "max_steps": config.steps, "batch_size": config.batch_size,
        "parallel.dtype": dtype, "lr": config.lr, "optimizer": "sgd", "seed": config.seed,
        "run_dir": str(run_dir), "verbosity": -1,
    }  # fmt: skip
    if method == "ddp":
        overrides.update({"parallel.dp": workers, "parallel.pp": 1, "parallel.microbatches": 1})
        partition: tuple[int, ...] | None = None
    else:
        mbs = config.batch_size // config.microbatches
        partition = _partition(config, workers, train[0][:mbs])
        overrides.update({"parallel.dp": 1, "parallel.pp": workers, "parallel.schedule": "gpipe",
                          "parallel.microbatches": config.microbatches,
                          "parallel.partition": list(partition)})  # fmt: skip
    start = time.perf_counter()
    summary = run(_model_factory(config.width), train, overrides,
                  metrics={"accuracy": accuracy}, validation=val)  # fmt: skip
    wall = time.perf_counter() - start
    steps = summary["steps"]
    return {"seconds": summary["step_time_s"] * steps, "wall_s": wall, "steps": steps,
            "accuracy": 100.0 * summary["validation"]["accuracy"],
            "final_loss": summary["final_loss"], "partition": partition}  # fmt: skip


def measure(config: DpGpipeConfig, *, done: dict[str, Any] | None = None,
            save: Callable[[str, Any], None] | None = None, run_root: Path,
            quiet: bool = False) -> dict[str, Any]:  # fmt: skip
    """Every (method, workers, dtype) cell; cells in `done` are kept (a resumed run),
    each new one is passed to `save` as soon as it is measured."""
    cells = dict(done or {})
    for dtype in config.dtypes:
        for w in config.workers:
            for method in METHODS:
                key = f"{method}/{w}/{dtype}"
                if key in cells:
                    continue
                cells[key] = measure_cell(
                    config, method, w, dtype, run_root / key.replace("/", "-")
                )
                if save:
                    save(key, cells[key])
                if not quiet:
                    c = cells[key]
                    print(f"dp-vs-gpipe: {key}: {c['seconds']:.1f} s, accuracy "
                          f"{c['accuracy']:.1f}%", file=sys.stderr, flush=True)  # fmt: skip
    return cells


def run_experiment(config: DpGpipeConfig, setup: PaperSetup | None = None, *, run_root: Path,
                   done: dict[str, Any] | None = None,
                   save: Callable[[str, Any], None] | None = None,
                   quiet: bool = False, train: bool = True) -> dict[str, Any]:  # fmt: skip
    """Measured here and predicted at the paper's scale, as one JSON-ready dict
    (`train` False: the prediction only, nothing measured)."""
    setup = setup or PaperSetup()
    measured = (
        {} if not train else measure(config, done=done, save=save, run_root=run_root, quiet=quiet)
    )
    # the paper's two tables, whatever was measured here (bf16 has no published table)
    predicted = predict(setup, dtypes=("fp32", "fp16"))
    return {"config": asdict(config), "measured": measured, "predicted": predicted}
