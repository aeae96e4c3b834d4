"""Updates, samples and epochs to a target validation loss, per schedule kind and pipeline
depth: seed 003's staleness experiment (seed 003 §4), reproduced on a character-level GPT.

Seed 003 simulated asynchronous pipelines on 1 to 16 GPUs and found that the epochs to a
target accuracy grow with the stage count, most from 8 on: 16 GPUs needed 52 epochs to 40%
top-1 where 1 GPU needed 30, since stage s of p computes on weights up to p-1-s updates
old. Here every schedule kind trains the same GPT (same seed) on the same data at every
depth through `plait.train.emulate`, which applies exactly the weight versions and updates
the distributed runtime would, in one process; the validation loss on a fixed set of
micro-batches is read every `eval_every` micro-batches. An epoch is one pass over a fixed
pool of `train_sequences` training sequences, visited in a seeded shuffled order.

Limits: a character-level GPT on the standard library's source stands in for the paper's
ResNet on CIFAR-class data, and a validation loss for top-1 accuracy. The budget is a few
epochs, not a run to convergence, so what carries over is how the epochs grow with depth,
not the paper's counts. Depth changes only which weight versions a micro-batch computes
on, never the arithmetic, so a synchronous kind (1f1b) gives the same curve at every depth.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from plait.data.corpus import CharCorpus, stdlib_corpus
from plait.models.gpt import GPT, GPTConfig
from plait.schedule.registry import KINDS, build, schedule_kind
from plait.train.emulate import Emulator, version_plan

__all__ = ["DEFAULT_SCHEDULES", "SEED_PAPER", "CurvePoint", "StalenessConfig", "StalenessResult",
           "StalenessRun", "plot", "require_matplotlib", "run_experiment"]  # fmt: skip

DEFAULT_SCHEDULES = ("1f1b", "pipedream", "pipedream-vs", "2bw", "spectrain", "xpipe")
# Measured on the default model and budget: AdamW at 1e-3 takes the 1-stage synchronous run
# smoothly from 4.6 (uniform) past 3.08 (the characters' unigram entropy) to about 2.7,
# where 3e-3 spikes on the way; SGD (momentum 0.9) learns at 0.3 and diverges at 1.0.
_DEFAULT_LR = {"adamw": 1e-3, "sgd": 0.3}
_TARGET_SLACK = 1.05  # auto target: 5% above the reference run's best validation loss
# the pairs where weight prediction should recover what staleness loses: (predicting, base)
_PAIRS = (("spectrain", "pipedream"), ("xpipe", "2bw"))
_POSITIVE = ("num_microbatches", "micro_batch_size", "seq_len", "num_layers", "hidden",
             "num_heads", "budget", "eval_every", "eval_batches", "train_sequences")  # fmt: skip
_SEED_TARGET = "40% top-1 (ResNet on CIFAR-class data, simulated in seed 003)"
SEED_PAPER: dict[str, Any] = {"gpus": [1, 16], "epochs_to_target": [30, 52], "target": _SEED_TARGET}


@dataclass(frozen=True, kw_only=True)
class StalenessConfig:
    """The schedule kinds and depths to train, the model, the optimizer and the budget.

    `budget` is micro-batches per run (a multiple of `num_microbatches`, the micro-batches
    of a window); `lr` None picks 1e-3 for AdamW, 0.3 for SGD (momentum 0.9). `target`
    None means auto: 1.05 × the best validation loss of the first schedule's run at the
    smallest stage count (1 by default).
    """

    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    stages: tuple[int, ...] = (1, 2, 4, 8, 16)
    num_microbatches: int = 4
    micro_batch_size: int = 8
    seq_len: int = 32
    num_layers: int = 14
    hidden: int = 48
    num_heads: int = 4
    optimizer: str = "adamw"
    lr: float | None = None
    budget: int = 320  # the 30 default runs: about 7 minutes on one CPU thread
    eval_every: int = 32
    eval_batches: int = 16
    target: float | None = None
    train_sequences: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            _require(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        _require(self.seed >= 0, f"seed={self.seed} must be >= 0")
        _require(self.hidden % self.num_heads == 0, f"hidden={self.hidden} is not divisible "
                 f"by num_heads={self.num_heads}: use a multiple of the head count")  # fmt: skip
        known = list(_DEFAULT_LR)
        _require(self.optimizer in known, f"optimizer={self.optimizer!r}: use one of {known}")
        for name, x in (("lr", self.lr), ("target", self.target)):
            why = f"{name}={x} must be a positive number, or None for the default"
            _require(x is None or (math.isfinite(x) and x > 0), why)
        m = self.num_microbatches
        for name in ("budget", "eval_every"):  # per-window kinds update every m micro-batches
            why = f"num_microbatches={m} (a window's micro-batches): use a multiple of {m}"
            _require(getattr(self, name) % m == 0, f"{name}={getattr(self, name)} is not a "
                     f"multiple of {why}")  # fmt: skip
        self._check_pipelines()

    @property
    def learning_rate(self) -> float:
        """`lr`, or the optimizer's default when `lr` is None."""
        return _DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

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
            why = f"{kind} at {stages[-1]} stages needs {needed} blocks (embedding, layers, head)"
            _require(needed <= self.num_layers + 2, f"num_layers={self.num_layers}: {why}; use "
                     f"num_layers >= {needed - 2} or fewer stages")  # fmt: skip


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class CurvePoint:
    """One validation: progress so far and the validation loss of the latest weights."""

    microbatches: int
    samples: int
    updates: int
    epochs: float
    val_loss: float


@dataclass(frozen=True)
class StalenessRun:
    """One schedule kind at one stage count: its validation curve and its wall time."""

    schedule: str
    stages: int
    curve: tuple[CurvePoint, ...]
    seconds: float

    def reached(self, target: float) -> CurvePoint | None:
        """The first validation at or under `target`, or None if none is."""
        return next((pt for pt in self.curve if pt.val_loss <= target), None)

    @property
    def best_val_loss(self) -> float:
        """The lowest finite validation loss (inf if the run diverged from the start)."""
        return min((v for pt in self.curve if math.isfinite(v := pt.val_loss)), default=math.inf)

    def to_dict(self, target: float) -> dict[str, Any]:
        hit = self.reached(target)
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            **{f"{k}_to_target": hit and getattr(hit, k) for k in ("updates", "samples", "epochs")},
            "final_val_loss": _finite(self.curve[-1].val_loss),
            "best_val_loss": _finite(self.best_val_loss),
            "seconds": self.seconds,
            "curve": [{**asdict(pt), "val_loss": _finite(pt.val_loss)} for pt in self.curve],
        }


@dataclass(frozen=True)
class StalenessResult:
    """Every run of the experiment and the target loss they are measured against."""

    config: StalenessConfig
    target: float
    runs: tuple[StalenessRun, ...]

    def epochs_to_target(self, schedule: str, stages: int) -> float | None:
        """Epochs until the run of `schedule` at `stages` first reached the target."""
        for run in self.runs:
            if (run.schedule, run.stages) == (schedule, stages):
                hit = run.reached(self.target)
                return None if hit is None else hit.epochs
        raise KeyError(f"no run of {schedule!r} at {stages} stages")

    def findings(self) -> list[str]:
        """Plain-English conclusions computed from the runs."""
        return _depth_findings(self) + _pair_findings(self) + [_seed_finding()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": {**asdict(self.config), "lr": self.config.learning_rate},
            "target": self.target,
            "runs": [run.to_dict(self.target) for run in self.runs],
            "seed_paper": SEED_PAPER,
            "findings": self.findings(),
        }


def run_experiment(config: StalenessConfig, *, quiet: bool = False) -> StalenessResult:
    """Train every schedule kind at every stage count; unless `quiet`, print one line per
    finished run to stderr. The first run is the auto target's reference."""
    data = _Data.build(config, stdlib_corpus())
    runs: list[StalenessRun] = []
    target = config.target
    for kind in config.schedules:
        for p in config.stages:
            start = time.perf_counter()
            curve = _train(config, data, kind=kind, num_stages=p)
            runs.append(run := StalenessRun(kind, p, curve, time.perf_counter() - start))
            target = run.best_val_loss * _TARGET_SLACK if target is None else target
            _require(math.isfinite(target), f"{kind} at {p} stages diverged: lower lr")
            if not quiet:
                hit = run.reached(target)
                epochs = "-" if hit is None else f"{hit.epochs:.2f}"
                line = f"{kind} p={p}: epochs to target {epochs} ({run.seconds:.1f} s)"
                print(f"staleness: {line}", file=sys.stderr, flush=True)
    assert target is not None  # the config asks for one or more runs
    return StalenessResult(config, target, tuple(runs))


# ------------------------------------------------------------------ training
@dataclass(frozen=True)
class _Data:
    """The training pool, the order its sequences are visited in, and the validation set."""

    inputs: torch.Tensor  # [train_sequences, seq_len]
    targets: torch.Tensor  # [train_sequences, seq_len]
    order: torch.Tensor  # [>= budget × micro_batch_size] pool rows, epoch after epoch
    val: tuple[torch.Tensor, torch.Tensor]  # [eval_batches × micro_batch_size, seq_len] each
    micro_batch_size: int
    vocab_size: int

    @staticmethod
    def build(c: StalenessConfig, corpus: CharCorpus) -> _Data:
        inputs, targets = corpus.batch(0, c.train_sequences, c.seq_len, seed=c.seed)
        num_val = c.eval_batches * c.micro_batch_size
        val = corpus.batch(0, num_val, c.seq_len, seed=c.seed, split="val")
        g = torch.Generator().manual_seed(c.seed)
        epochs = math.ceil(c.budget * c.micro_batch_size / c.train_sequences)
        order = torch.cat([torch.randperm(c.train_sequences, generator=g) for _ in range(epochs)])
        return _Data(inputs, targets, order, val, c.micro_batch_size, corpus.vocab_size)

    def microbatch(self, x: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.order[x * self.micro_batch_size : (x + 1) * self.micro_batch_size]
        return self.inputs[rows], self.targets[rows]


class _Recorder:
    """`after_update` of the emulator: counts the micro-batches applied so far (updates
    apply them in the plan's order, not by index) and validates every `eval_every`."""

    def __init__(self, config: StalenessConfig, model: GPT, val: tuple[torch.Tensor, torch.Tensor]):
        self.config, self.model, self.val = config, model, val
        self.microbatches = 0
        self.next_eval = config.eval_every
        self.curve = [self._point(updates=0)]

    def __call__(self, u: int, losses: list[float]) -> None:
        self.microbatches += len(losses)
        if self.microbatches >= self.next_eval or self.microbatches == self.config.budget:
            self.curve.append(self._point(updates=u + 1))
            while self.next_eval <= self.microbatches:
                self.next_eval += self.config.eval_every

    @torch.no_grad()
    def _point(self, *, updates: int) -> CurvePoint:
        samples = self.microbatches * self.config.micro_batch_size
        self.model.eval()  # the validation loss of the model as it is, dropout or not
        loss = float(GPT.loss(self.model(self.val[0]), self.val[1]))
        self.model.train()
        epochs = samples / self.config.train_sequences
        return CurvePoint(self.microbatches, samples, updates, epochs, loss)


def _train(
    c: StalenessConfig, data: _Data, *, kind: str, num_stages: int
) -> tuple[CurvePoint, ...]:
    plan = version_plan(build(kind, num_stages, c.num_microbatches), c.budget // c.num_microbatches)
    torch.manual_seed(c.seed)  # the same initial weights at every depth and kind
    shape = {"num_layers": c.num_layers, "hidden": c.hidden, "num_heads": c.num_heads}
    model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=c.seq_len, **shape))
    lr = c.learning_rate

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if c.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=lr)

    emulator = Emulator(model, plan.num_stages, optimizer, GPT.loss)
    recorder = _Recorder(c, model, data.val)
    emulator.train(plan, data.microbatch, after_update=recorder)
    return tuple(recorder.curve)


# ------------------------------------------------------------------ findings
def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN or infinity


def _epochs(result: StalenessResult, e: float | None) -> str:
    if e is not None:
        return f"{e:.2f} epochs"
    c = result.config
    return f"more than {c.budget * c.micro_batch_size / c.train_sequences:.2f} epochs (not reached)"


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


# ------------------------------------------------------------------ plot
def require_matplotlib() -> Any:
    """matplotlib's pyplot on the Agg backend, or an error saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plotting the staleness curves needs matplotlib, which is not installed: "
            "pip install matplotlib (or pip install 'plait[plot]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: StalenessResult, path: str | Path) -> Path:
    """A PNG: one panel per schedule kind, validation loss against epochs, a line per stage
    count, the target dashed."""
    plt = require_matplotlib()
    kinds = result.config.schedules
    cols = min(3, len(kinds))
    rows = math.ceil(len(kinds) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False,
                             sharex=True, sharey=True)  # fmt: skip
    for ax, kind in zip(axes.flat, kinds, strict=False):
        for run in (r for r in result.runs if r.schedule == kind):
            ax.plot([pt.epochs for pt in run.curve], [pt.val_loss for pt in run.curve],
                    label=f"p={run.stages}", linewidth=1.2)  # fmt: skip
        ax.axhline(result.target, linestyle="--", color="black", linewidth=0.8, label="target")
        ax.set_title(kind, fontsize=9, loc="left")
        ax.grid(linewidth=0.3)
    for ax in axes.flat[len(kinds) :]:
        ax.axis("off")
    axes.flat[0].set_ylim(*_loss_range(result.runs, result.target))
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel("epochs")
    fig.supylabel("validation loss")
    fig.suptitle("epochs to a target validation loss, per pipeline depth (seed 003 §4)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _loss_range(runs: Sequence[StalenessRun], target: float) -> tuple[float, float]:
    """Up to the first validation after training starts: the initial loss (ln of the
    alphabet size) would flatten the part that matters."""
    best = min(min(run.best_val_loss for run in runs), target)
    early = [run.curve[1].val_loss for run in runs if len(run.curve) > 1]
    top = max((v for v in early if math.isfinite(v)), default=best + 1.0)
    return best - 0.05 * (top - best), max(top, target + 0.1)
