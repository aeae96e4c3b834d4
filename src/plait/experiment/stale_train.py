"""What one schedule kind at one pipeline depth trains to, in one process: its validation
curve against samples, updates and emulated wall time.

Two regimes (`Workload`): the papers' own, a VGG-style CNN (`plait.models.SmallVGG`) on
scikit-learn's 8×8 digits with SGD and momentum, as PipeDream, SpecTrain, XPipe and HetPipe
trained CNNs; and a character-level GPT on the standard library's source with AdamW. Every
run visits the same training samples in the same seeded order (an epoch is one pass over
the pool) and is validated on the same held-out set (loss, and top-1 accuracy for the
classifier). Training goes through `plait.emulate.versions`, which applies exactly the weight
versions and updates the distributed runtime would (the tests hold both to the papers'
rules).

The papers' remedies for staleness, as options of a run (`REMEDIES`):
- `lr-warmup`, PipeDream's (Narayanan et al., SOSP 2019; `--lr_warmup` in its code): the
  learning rate rises linearly over the first `warmup_epochs` epochs, update k at
  lr·(k+1)/W for W warm-up updates;
- `staleness-lr`, staleness-aware learning rates (Zhang, Gupta, Lian and Liu, IJCAI 2016,
  "Staleness-aware async-SGD"): stage s steps at lr/(1 + τ_s), τ_s the most updates its
  weights lag behind (`VersionPlan.stage_lags`), so the stale stages take smaller steps.

Wall time is emulated: the run's own schedule replayed (`plait.schedule.replay`) with each
stage's forward taking 1/p of the whole model's, its backward twice that, scaled by the
micro-batch's share of an update's samples, so the unit is one forward of the whole model
over an update's samples, on any depth; an update happens when its last stage has applied it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.emulate.versions import Emulator, VersionPlan, version_plan
from plait.schedule import Op, Schedule
from plait.schedule.replay import replay, unit_duration

__all__ = ["REMEDIES", "CurvePoint", "Workload", "gpt_workload", "image_workload", "train_run",
           "update_times"]  # fmt: skip

REMEDIES = ("none", "lr-warmup", "staleness-lr")


@dataclass(frozen=True)
class CurvePoint:
    """One validation: progress so far, the validation loss (and accuracy) of the latest
    weights, and the emulated time (one whole-model forward over an update's samples = 1)."""

    microbatches: int
    samples: int
    updates: int
    epochs: float
    val_loss: float
    val_accuracy: float | None
    time: float


@dataclass(frozen=True)
class Workload:
    """A regime's model, loss and data: a pool of training samples visited in `order`
    (epoch after epoch, each a seeded permutation) and a validation set."""

    name: str
    build: Callable[[], nn.Module]
    loss: Callable[[Any, Any], torch.Tensor]
    inputs: torch.Tensor
    targets: torch.Tensor
    order: torch.Tensor
    val: tuple[torch.Tensor, torch.Tensor]
    classifier: bool

    @property
    def pool(self) -> int:
        return len(self.targets)

    def rows(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [first, first + count) of the training stream."""
        picked = self.order[first : first + count]
        return self.inputs[picked], self.targets[picked]


def _order(pool: int, samples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    epochs = max(1, math.ceil(samples / pool))
    return torch.cat([torch.randperm(pool, generator=g) for _ in range(epochs)])


def image_workload(*, width: int, samples: int, seed: int) -> Workload:
    """`SmallVGG(width)` on scikit-learn's digits (its training split, 1,438 images; the
    validation split, 359), enough order for `samples` training samples."""
    from plait.data.images import digits
    from plait.models.vgg_small import SmallVGG

    data = digits()
    return Workload(
        name="image",
        build=lambda: SmallVGG(width=width, num_classes=data.num_classes),
        loss=SmallVGG.loss,
        inputs=data.train_images,
        targets=data.train_labels,
        order=_order(len(data.train_labels), samples, seed),
        val=(data.val_images, data.val_labels),
        classifier=True,
    )


def gpt_workload(
    *, shape: dict[str, int], seq_len: int, pool: int, val_sequences: int, samples: int, seed: int
) -> Workload:
    """A GPT of `shape` on `pool` sequences of the standard library's source (validation:
    `val_sequences` of its held-out split)."""
    from plait.data.corpus import stdlib_corpus
    from plait.models.gpt import GPT, GPTConfig

    corpus = stdlib_corpus()
    inputs, targets = corpus.batch(0, pool, seq_len, seed=seed)
    config = GPTConfig(vocab_size=corpus.vocab_size, seq_len=seq_len, **shape)
    return Workload(
        name="gpt",
        build=lambda: GPT(config),
        loss=GPT.loss,
        inputs=inputs,
        targets=targets,
        order=_order(pool, samples, seed),
        val=corpus.batch(0, val_sequences, seq_len, seed=seed, split="val"),
        classifier=False,
    )


@dataclass(frozen=True, kw_only=True)
class _Run:
    workload: Workload
    plan: VersionPlan
    micro_batch_size: int
    samples_per_update: int
    eval_every: int  # samples
    times: list[float]  # emulated end of each update


class _Recorder:
    """`after_update` of the emulator: counts the samples applied so far and validates
    the latest weights every `eval_every` samples and after the last update."""

    def __init__(self, run: _Run, model: nn.Module) -> None:
        self.run, self.model = run, model
        self.microbatches = 0
        self.next_eval = run.eval_every
        self.curve = [self._point(updates=0)]

    def __call__(self, u: int, losses: list[float]) -> None:
        self.microbatches += len(losses)
        samples = self.microbatches * self.run.micro_batch_size
        if samples >= self.next_eval or u + 1 == len(self.run.plan.groups):
            self.curve.append(self._point(updates=u + 1))
            while self.next_eval <= samples:
                self.next_eval += self.run.eval_every

    @torch.no_grad()
    def _point(self, *, updates: int) -> CurvePoint:
        samples = self.microbatches * self.run.micro_batch_size
        w = self.run.workload
        self.model.eval()  # the validation of the model as it is, dropout or not
        out = self.model(w.val[0])
        self.model.train()
        loss = float(w.loss(out, w.val[1]))
        accuracy = float((out.argmax(-1) == w.val[1]).float().mean()) if w.classifier else None
        time = self.run.times[updates - 1] if updates else 0.0
        return CurvePoint(self.microbatches, samples, updates, samples / w.pool, loss,
                          accuracy, time)  # fmt: skip


def train_run(
    workload: Workload,
    schedule: Schedule,
    windows: int,
    *,
    micro_batch_size: int,
    samples_per_update: int,
    eval_every: int,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    remedy: str = "none",
    warmup_epochs: float = 1.0,
    seed: int = 0,
) -> tuple[CurvePoint, ...]:
    """The validation curve of `workload` trained for `windows` windows of `schedule`
    (drain included), micro-batch x being samples [x·size, (x+1)·size) of the stream."""
    if remedy not in REMEDIES:
        raise ValueError(f"remedy={remedy!r} is unknown: use one of {list(REMEDIES)}")
    plan = version_plan(schedule, windows)
    share = micro_batch_size / samples_per_update
    run = _Run(workload=workload, plan=plan, micro_batch_size=micro_batch_size,
               samples_per_update=samples_per_update, eval_every=eval_every,
               times=update_times(schedule, windows, share))  # fmt: skip
    torch.manual_seed(seed)  # the same initial weights at every depth and kind
    model = workload.build()
    emulator = Emulator(model, plan.num_stages, optimizer, workload.loss)
    recorder = _Recorder(run, model)
    per_epoch = workload.pool / samples_per_update
    emulator.train(
        plan,
        lambda x: workload.rows(x * micro_batch_size, micro_batch_size),
        after_update=recorder,
        lr_scale=_remedy(remedy, plan, warmup_updates=max(1, round(warmup_epochs * per_epoch))),
    )
    return tuple(recorder.curve)


def _remedy(
    remedy: str, plan: VersionPlan, *, warmup_updates: int
) -> Callable[[int, int], float] | None:
    if remedy == "lr-warmup":
        return lambda s, u: min(1.0, (u + 1) / warmup_updates)
    if remedy == "staleness-lr":
        lags = plan.stage_lags
        return lambda s, u: 1.0 / (1 + lags[s])
    return None


def update_times(schedule: Schedule, windows: int, share: float) -> list[float]:
    """When each update of `windows` windows of `schedule` is done on every stage, the
    schedule replayed with a stage's forward 1/p × `share` (backward twice that)."""
    scale = share / schedule.num_stages
    ran = replay(schedule, duration=lambda r, a: unit_duration(r, a) * scale, windows=windows)
    per_stage: dict[int, list[float]] = {}
    for events in ran.events:
        for e in events:
            if e.action.op is Op.UPDATE:
                per_stage.setdefault(e.action.stage, []).append(e.end)
    counts = {len(ends) for ends in per_stage.values()}
    assert len(counts) == 1, "every stage applies every update"
    return [max(ends[u] for ends in per_stage.values()) for u in range(counts.pop())]
