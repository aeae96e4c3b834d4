"""Updates, samples and epochs to a target validation metric, per schedule kind and
pipeline depth: seed 003's staleness experiment (seed 003 §4), in two regimes.

Seed 003 simulated asynchronous pipelines on 1 to 16 GPUs and found that the epochs to a
target accuracy grow with the stage count, most from 8 on: 16 GPUs needed 52 epochs to 40%
top-1 where 1 GPU needed 30, since stage s of p computes on weights up to p-1-s updates
old. Here every schedule kind trains the same model (same seed) on the same data at every
depth in one process (`plait.experiment.stale_train`, through `plait.emulate.versions`, which
applies exactly the weight versions and updates the distributed runtime would), validated
every `eval_every`. Regimes: `image`, the papers' (a VGG-style CNN on scikit-learn's 8×8
digits, SGD with momentum 0.9, the target a top-1 accuracy), and `gpt` (a character-level
GPT on the standard library's source, AdamW, the target a validation loss).

`equal_updates` makes every kind update on the same `micro_batch_size` samples (a kind
that updates once per window splits them into `num_microbatches` micro-batches), so a
synchronous run (1f1b) is the one-device reference every kind is measured against, as
PipeDream and SpecTrain measure against one GPU at the same minibatch; `budget` and
`eval_every` then count updates. Otherwise they count micro-batches of `micro_batch_size`
and a per-window kind updates on `num_microbatches` of them. `remedy` applies a paper's
remedy for staleness to every run (`stale_train.REMEDIES`).

Limits: small models and data stand in for the papers' ImageNet-class runs; depth changes
only which weight versions a micro-batch computes on, never the arithmetic, so a
synchronous kind gives the same curve at every depth.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from plait.experiment.stale_train import (
    REMEDIES,
    CurvePoint,
    Workload,
    gpt_workload,
    image_workload,
    train_run,
    update_times,
)
from plait.schedule.registry import KINDS, build, schedule_kind

__all__ = ["DEFAULT_SCHEDULES", "SEED_PAPER", "CurvePoint", "StalenessConfig", "StalenessResult",
           "StalenessRun", "run_experiment"]  # fmt: skip

DEFAULT_SCHEDULES = ("1f1b", "pipedream", "pipedream-vs", "2bw", "spectrain", "xpipe")
# Measured on the default models and budgets: AdamW at 1e-3 takes the 1-stage synchronous
# GPT smoothly from 4.6 (uniform) past 3.08 (the characters' unigram entropy) to about 2.7,
# where 3e-3 spikes on the way; SGD (momentum 0.9) learns the GPT at 0.3 and diverges at
# 1.0; the CNN on digits learns at 0.02 with momentum 0.9, as in the papers' CNN runs.
_DEFAULT_OPTIMIZER = {"gpt": "adamw", "image": "sgd"}
_DEFAULT_LR = {("gpt", "adamw"): 1e-3, ("gpt", "sgd"): 0.3, ("image", "sgd"): 0.02,
               ("image", "adamw"): 1e-3}  # fmt: skip
_TARGET_SLACK = 1.05  # auto loss target: 5% above the reference run's best validation loss
# auto accuracy target: 95% of the reference run's best, where its curve still climbs (a
# target on the plateau is crossed by noise, not by learning)
_ACCURACY_SLACK = 0.95
_IMAGE_BLOCKS = 8  # SmallVGG's
# the pairs where weight prediction should recover what staleness loses: (predicting, base)
_PAIRS = (("spectrain", "pipedream"), ("xpipe", "2bw"))
_POSITIVE = ("num_microbatches", "micro_batch_size", "seq_len", "num_layers", "hidden",
             "num_heads", "budget", "eval_every", "eval_batches", "train_sequences",
             "width")  # fmt: skip
_SEED_TARGET = "40% top-1 (ResNet on CIFAR-class data, simulated in seed 003)"
SEED_PAPER: dict[str, Any] = {"gpus": [1, 16], "epochs_to_target": [30, 52], "target": _SEED_TARGET}


@dataclass(frozen=True, kw_only=True)
class StalenessConfig:
    """The schedule kinds and depths to train, the regime, the optimizer and the budget.

    `budget` is micro-batches per run (updates with `equal_updates`; a multiple of
    `num_microbatches`, the micro-batches of a window); `optimizer` None is the regime's
    (AdamW for gpt, SGD with momentum 0.9 for image); `lr` None its default. `target`
    None means auto, from the first schedule's run at the smallest stage count (1 by
    default): 1.05 × its best validation loss (gpt), or 0.95 × its best validation
    accuracy (image). The GPT's shape is `num_layers`, `hidden`, `num_heads` and
    `seq_len`, its pool `train_sequences` (validated on `eval_batches` micro-batches);
    the CNN's is `width` (channels of its first convolutions), its pool the digits'.
    """

    regime: str = "gpt"
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    stages: tuple[int, ...] = (1, 2, 4, 8, 16)
    num_microbatches: int = 4
    micro_batch_size: int = 8
    seq_len: int = 32
    num_layers: int = 14
    hidden: int = 48
    num_heads: int = 4
    width: int = 16
    optimizer: str | None = None
    lr: float | None = None
    budget: int = 320  # the 30 default runs: about 7 minutes on one CPU thread
    eval_every: int = 32
    eval_batches: int = 16
    target: float | None = None
    train_sequences: int = 1024
    equal_updates: bool = False
    remedy: str = "none"
    warmup_epochs: float = 1.0  # the lr-warmup remedy's
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.regime in _DEFAULT_OPTIMIZER,
                 f"regime={self.regime!r}: use one of {list(_DEFAULT_OPTIMIZER)}")  # fmt: skip
        for name in _POSITIVE:
            _require(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        _require(self.seed >= 0, f"seed={self.seed} must be >= 0")
        _require(self.hidden % self.num_heads == 0, f"hidden={self.hidden} is not divisible "
                 f"by num_heads={self.num_heads}: use a multiple of the head count")  # fmt: skip
        known = sorted({o for _, o in _DEFAULT_LR})
        _require(self.optimizer in (None, *known),
                 f"optimizer={self.optimizer!r}: use one of {known}")  # fmt: skip
        for name, x in (("lr", self.lr), ("target", self.target)):
            why = f"{name}={x} must be a positive number, or None for the default"
            _require(x is None or (math.isfinite(x) and x > 0), why)
        _require(self.remedy in REMEDIES, f"remedy={self.remedy!r}: use one of {list(REMEDIES)}")
        _require(self.warmup_epochs > 0, f"warmup_epochs={self.warmup_epochs} must be > 0")
        m = self.num_microbatches
        for name in ("budget", "eval_every"):  # per-window kinds update every m micro-batches
            why = f"num_microbatches={m} (a window's micro-batches): use a multiple of {m}"
            _require(getattr(self, name) % m == 0, f"{name}={getattr(self, name)} is not a "
                     f"multiple of {why}")  # fmt: skip
        _require(not self.equal_updates or self.micro_batch_size % m == 0,
                 f"micro_batch_size={self.micro_batch_size} with equal_updates: per-window "
                 f"kinds split it into num_microbatches={m}; use a multiple of {m}")  # fmt: skip
        self._check_pipelines()

    @property
    def optimizer_name(self) -> str:
        """`optimizer`, or the regime's when it is None."""
        return self.optimizer or _DEFAULT_OPTIMIZER[self.regime]

    @property
    def learning_rate(self) -> float:
        """`lr`, or the regime's and optimizer's default when `lr` is None."""
        return _DEFAULT_LR[(self.regime, self.optimizer_name)] if self.lr is None else self.lr

    @property
    def metric(self) -> str:
        """What the target bounds: `val_accuracy` (from above) or `val_loss` (from below)."""
        return "val_accuracy" if self.regime == "image" else "val_loss"

    def _check_pipelines(self) -> None:
        kinds, stages = list(self.schedules), list(self.stages)
        _require(bool(kinds) and len(set(kinds)) == len(kinds),
                 f"schedules={kinds}: name one or more distinct kinds")  # fmt: skip
        for kind in kinds:
            try:
                schedule_kind(kind)
            except ValueError as err:
                raise ValueError(f"schedules: {err}") from None
        _require(bool(stages) and min(stages) >= 1 and stages == sorted(set(stages)),
                 f"stages={stages}: give distinct counts >= 1 in increasing order")  # fmt: skip
        for kind in kinds:
            needed = stages[-1] * KINDS[kind].default_chunks
            if self.regime == "image":
                _require(needed <= _IMAGE_BLOCKS, f"stages={stages}: {kind} at {stages[-1]} "
                         f"stages needs {needed} blocks, the CNN has {_IMAGE_BLOCKS}")  # fmt: skip
                continue
            why = f"{kind} at {stages[-1]} stages needs {needed} blocks (embedding, layers, head)"
            _require(needed <= self.num_layers + 2, f"num_layers={self.num_layers}: {why}; use "
                     f"num_layers >= {needed - 2} or fewer stages")  # fmt: skip


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class StalenessRun:
    """One schedule kind at one stage count: its validation curve and its wall time."""

    schedule: str
    stages: int
    curve: tuple[CurvePoint, ...]
    seconds: float
    metric: str = "val_loss"

    def reached(self, target: float) -> CurvePoint | None:
        """The first validation at or under `target` (an accuracy: at or over it), or None."""
        if self.metric == "val_accuracy":
            return next((pt for pt in self.curve if (pt.val_accuracy or 0.0) >= target), None)
        return next((pt for pt in self.curve if pt.val_loss <= target), None)

    @property
    def best_val_loss(self) -> float:
        """The lowest finite validation loss (inf if the run diverged from the start)."""
        return min((v for pt in self.curve if math.isfinite(v := pt.val_loss)), default=math.inf)

    @property
    def best_val_accuracy(self) -> float:
        return max((pt.val_accuracy or 0.0 for pt in self.curve), default=0.0)

    def to_dict(self, target: float) -> dict[str, Any]:
        hit = self.reached(target)
        keys = ("updates", "samples", "epochs", "time")
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            **{f"{k}_to_target": hit and getattr(hit, k) for k in keys},
            "final_val_loss": _finite(self.curve[-1].val_loss),
            "best_val_loss": _finite(self.best_val_loss),
            "best_val_accuracy": self.best_val_accuracy if self.metric == "val_accuracy" else None,
            "seconds": self.seconds,
            "curve": [{**asdict(pt), "val_loss": _finite(pt.val_loss)} for pt in self.curve],
        }


@dataclass(frozen=True)
class StalenessResult:
    """Every run of the experiment and the target they are measured against."""

    config: StalenessConfig
    target: float
    runs: tuple[StalenessRun, ...]

    def run(self, schedule: str, stages: int) -> StalenessRun:
        for run in self.runs:
            if (run.schedule, run.stages) == (schedule, stages):
                return run
        raise KeyError(f"no run of {schedule!r} at {stages} stages")

    def epochs_to_target(self, schedule: str, stages: int) -> float | None:
        """Epochs until the run of `schedule` at `stages` first reached the target."""
        hit = self.run(schedule, stages).reached(self.target)
        return None if hit is None else hit.epochs

    def findings(self) -> list[str]:
        """Plain-English conclusions computed from the runs."""
        return _depth_findings(self) + _pair_findings(self) + [_seed_finding()]

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "config": {**asdict(c), "lr": c.learning_rate, "optimizer": c.optimizer_name},
            "metric": c.metric,
            "target": self.target,
            "runs": [run.to_dict(self.target) for run in self.runs],
            "seed_paper": SEED_PAPER,
            "findings": self.findings(),
        }


def run_experiment(config: StalenessConfig, *, quiet: bool = False) -> StalenessResult:
    """Train every schedule kind at every stage count; unless `quiet`, print one line per
    finished run to stderr. The first run is the auto target's reference."""
    workload = _workload(config)
    runs: list[StalenessRun] = []
    target = config.target
    for kind in config.schedules:
        for p in config.stages:
            start = time.perf_counter()
            curve = _train(config, workload, kind=kind, num_stages=p, done=runs)
            run = StalenessRun(kind, p, curve, time.perf_counter() - start, config.metric)
            runs.append(run)
            target = _auto_target(run) if target is None else target
            _require(math.isfinite(target), f"{kind} at {p} stages diverged: lower lr")
            if not quiet:
                hit = run.reached(target)
                epochs = "-" if hit is None else f"{hit.epochs:.2f}"
                line = f"{kind} p={p}: epochs to target {epochs} ({run.seconds:.1f} s)"
                print(f"staleness: {line}", file=sys.stderr, flush=True)
    assert target is not None  # the config asks for one or more runs
    return StalenessResult(config, target, tuple(runs))


def _auto_target(run: StalenessRun) -> float:
    if run.metric == "val_accuracy":
        return run.best_val_accuracy * _ACCURACY_SLACK
    return run.best_val_loss * _TARGET_SLACK


# ------------------------------------------------------------------ training
def _workload(c: StalenessConfig) -> Workload:
    samples = c.budget * c.micro_batch_size  # the most any kind visits
    if c.regime == "image":
        return image_workload(width=c.width, samples=samples, seed=c.seed)
    shape = {"num_layers": c.num_layers, "hidden": c.hidden, "num_heads": c.num_heads}
    return gpt_workload(shape=shape, seq_len=c.seq_len, pool=c.train_sequences,
                        val_sequences=c.eval_batches * c.micro_batch_size, samples=samples,
                        seed=c.seed)  # fmt: skip


@dataclass(frozen=True)
class _Shape:
    """How `kind` at `p` stages runs under the config: its schedule and windows, its
    micro-batches' samples and an update's."""

    schedule: Any
    windows: int
    micro_batch_size: int
    samples_per_update: int


def _shape(c: StalenessConfig, kind: str, num_stages: int) -> _Shape:
    m, per_micro = c.num_microbatches, KINDS[kind].per_microbatch
    whole = per_micro or not c.equal_updates  # micro-batches of micro_batch_size samples
    return _Shape(build(kind, num_stages, m), c.budget // m if whole else c.budget,
                  c.micro_batch_size if whole else c.micro_batch_size // m,
                  c.micro_batch_size * (1 if per_micro or c.equal_updates else m))  # fmt: skip


def _train(
    c: StalenessConfig, workload: Workload, *, kind: str, num_stages: int, done: list[StalenessRun]
) -> tuple[CurvePoint, ...]:
    """The curve of `kind` at `num_stages`; a synchronous kind computes the same at every
    depth, so its first run's curve is reused, with this depth's emulated times."""
    shape = _shape(c, kind, num_stages)
    same = [r for r in done if r.schedule == kind and KINDS[kind].synchronous]
    if same:
        share = shape.micro_batch_size / shape.samples_per_update
        times = update_times(shape.schedule, shape.windows, share)
        return tuple(dataclasses.replace(pt, time=times[pt.updates - 1] if pt.updates else 0.0)
                     for pt in same[0].curve)  # fmt: skip
    lr = c.learning_rate

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if c.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=lr)

    return train_run(
        workload,
        shape.schedule,
        shape.windows,
        micro_batch_size=shape.micro_batch_size,
        samples_per_update=shape.samples_per_update,
        eval_every=c.eval_every * c.micro_batch_size,
        optimizer=optimizer,
        remedy=c.remedy,
        warmup_epochs=c.warmup_epochs,
        seed=c.seed,
    )


# ------------------------------------------------------------------ findings
def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN or infinity


def _epochs(result: StalenessResult, e: float | None) -> str:
    if e is not None:
        return f"{e:.2f} epochs"
    budget = max(run.curve[-1].epochs for run in result.runs)
    return f"more than {budget:.2f} epochs (not reached)"


def _depth_findings(result: StalenessResult) -> list[str]:
    stages = result.config.stages
    lo, hi, out = stages[0], stages[-1], []
    for kind in result.config.schedules if lo < hi else ():
        a, b = result.epochs_to_target(kind, lo), result.epochs_to_target(kind, hi)
        ratio = f" ({b / a:.2f}×)" if a and b else ""
        hits = ", ".join(str(p) for p in stages if result.epochs_to_target(kind, p) is not None)
        out.append(f"{kind}{' (synchronous)' * KINDS[kind].synchronous}: reaches the target at "
                   f"{'p=' + hits if hits else 'no depth'}; {hi} stages need {_epochs(result, b)}, "
                   f"{lo} stage{'s' * (lo > 1)} {_epochs(result, a)}{ratio}")  # fmt: skip
    return out


def _pair_findings(result: StalenessResult) -> list[str]:
    out = []
    for predicting, base in _PAIRS:
        if not {predicting, base} <= set(result.config.schedules):
            continue
        verdict: dict[str, list[str]] = {}
        for p in result.config.stages:
            a = _or_inf(result.epochs_to_target(predicting, p))
            b = _or_inf(result.epochs_to_target(base, p))
            key = "neither reaches it" if a == b == math.inf else (
                "fewer" if a < b else "more" if b < a else "as many")  # fmt: skip
            verdict.setdefault(key, []).append(str(p))
        said = "; ".join(f"{k} at p={', '.join(ps)}" for k, ps in verdict.items())
        out.append(f"{predicting} (weight prediction) vs {base}, epochs to the target: {said}")
    return out


def _or_inf(epochs: float | None) -> float:
    return math.inf if epochs is None else epochs  # never reached: more than any count


def _seed_finding() -> str:
    (g1, g2), (e1, e2) = SEED_PAPER["gpus"], SEED_PAPER["epochs_to_target"]
    return f"seed 003: {g2} GPUs needed {e2} epochs where {g1} needed {e1} ({e2 / e1:.2f}×)"
