"""The staleness experiment's figure: validation curves per schedule kind and depth.

One panel per schedule kind, a line per stage count, the target dashed; the x axis is
epochs (seed 003's measure) or the emulated wall time (`plait.experiment.stale_train`), the
y axis the validation loss or, for the classifier, its top-1 accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.experiment.staleness import StalenessResult, StalenessRun

__all__ = ["plot", "require_matplotlib"]

_X = {"epochs": "epochs", "time": "emulated time (whole-model forwards of one update's samples)",
      "updates": "updates"}  # fmt: skip


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


def plot(result: StalenessResult, path: str | Path, *, x: str = "epochs") -> Path:
    """A PNG: one panel per schedule kind, the validation metric against `x` ("epochs",
    "time" or "updates"), a line per stage count, the target dashed."""
    plt = require_matplotlib()
    metric = result.config.metric
    kinds = result.config.schedules
    cols = min(3, len(kinds))
    rows = math.ceil(len(kinds) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False,
                             sharex=True, sharey=True)  # fmt: skip
    for ax, kind in zip(axes.flat, kinds, strict=False):
        for run in (r for r in result.runs if r.schedule == kind):
            ax.plot([getattr(pt, x) for pt in run.curve], [_y(pt, metric) for pt in run.curve],
                    label=f"p={run.stages}", linewidth=1.2)  # fmt: skip
        ax.axhline(result.target, linestyle="--", color="black", linewidth=0.8, label="target")
        ax.set_title(kind, fontsize=9, loc="left")
        ax.grid(linewidth=0.3)
    for ax in axes.flat[len(kinds) :]:
        ax.axis("off")
    axes.flat[0].set_ylim(*_range(result.runs, result.target, metric))
    axes.flat[0].legend(fontsize=7)
    what = "top-1 accuracy" if metric == "val_accuracy" else "loss"
    fig.supxlabel(_X[x])
    fig.supylabel(f"validation {what}")
    fig.suptitle(f"{result.config.regime}: validation {what} against {x}, per pipeline depth")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _y(point: Any, metric: str) -> float:
    value = getattr(point, metric)
    return math.nan if value is None else float(value)


def _range(runs: Sequence[StalenessRun], target: float, metric: str) -> tuple[float, float]:
    """From the first validation after training starts: the initial value (chance, or ln
    of the alphabet size) would flatten the part that matters."""
    early = [_y(run.curve[1], metric) for run in runs if len(run.curve) > 1]
    early = [v for v in early if math.isfinite(v)]
    if metric == "val_accuracy":
        best = max(max(run.best_val_accuracy for run in runs), target)
        low = min(min(early, default=best - 0.2), target - 0.05)
        return low, best + 0.05 * (best - low)
    best = min(min(run.best_val_loss for run in runs), target)
    top = max(early, default=best + 1.0)
    return best - 0.05 * (top - best), max(top, target + 0.1)
