"""The PNGs of `convergence.md`: validation or training loss against updates (or epochs)
and against wall time, a panel per method or depth, from `plait experiment convergence`'s
results."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["draw"]

Series = dict[str, tuple[list[float], list[float]]]  # label -> (x, y)


def draw(data: dict[str, Any], out: Path) -> dict[str, Any]:
    """{section: [PNG file names]} for the sections in `data`, or {"error": why}."""
    from plait.experiment.staleness_plot import require_matplotlib

    try:
        plt = require_matplotlib()
    except RuntimeError as err:
        return {"error": str(err)}
    made: dict[str, Any] = {}
    for regime in ("image", "gpt"):
        if regime in data:
            made[regime] = _staleness(plt, data[regime]["main"], out, regime)
    if "compress" in data:
        made["compress"] = _compress(plt, data["compress"]["result"], out)
    if "wsp" in data:
        made["wsp"] = _wsp(plt, data["wsp"]["results"], out)
    return made


def _staleness(plt: Any, main: dict[str, Any], out: Path, regime: str) -> list[str]:
    metric = main["metric"]
    kinds = main["config"]["schedules"]
    names = []
    emulated = "emulated time (whole-model forwards of an update's samples)"
    for x, label in (("epochs", "epochs"), ("time", emulated)):
        panels = {}
        for kind in kinds:
            runs = [r for r in main["runs"] if r["schedule"] == kind]
            panels[kind] = {f"p={r['stages']}": ([pt[x] for pt in r["curve"]],
                                                  [_y(pt[metric]) for pt in r["curve"]])
                            for r in runs}  # fmt: skip
        what = "top-1 accuracy" if metric == "val_accuracy" else "loss"
        name = f"convergence-{regime}-{x}.png"
        _panels(plt, panels, label, f"validation {what}", main["target"], out / name,
                title=f"{regime}: validation {what} against {x}, per kind and depth")  # fmt: skip
        names.append(name)
    return names


def _compress(plt: Any, res: dict[str, Any], out: Path) -> list[str]:
    names = []
    for w, per in res["workers"].items():
        methods = per["methods"]
        steps: Series = {m: (_count(r["curve"]["loss"]), r["curve"]["loss"])
                         for m, r in methods.items()}  # fmt: skip
        seconds = {m: (r["curve"]["end_s"], r["curve"]["loss"]) for m, r in methods.items()}
        name = f"convergence-compress-{w}.png"
        _panels(plt, {"against steps": steps, "against seconds": seconds}, "steps | seconds",
                "training loss", None, out / name,
                title=f"gradient compression, {w} workers: training loss")  # fmt: skip
        names.append(name)
    return names


def _wsp(plt: Any, results: list[dict[str, Any]], out: Path) -> list[str]:
    names = []
    for res in results:
        opt, d = res["config"]["optimizer"], res["config"]["staleness"]
        confs = ("equal_dp", "hetero_sync", "wsp")
        steps: Series = {n: (_count(res[n]["curve"]["loss"]), res[n]["curve"]["loss"])
                         for n in confs}  # fmt: skip
        seconds = {n: (res[n]["curve"]["end_s"], res[n]["curve"]["loss"]) for n in confs}
        name = f"convergence-wsp-{opt}-d{d}.png"
        _panels(plt, {"against updates": steps, "against seconds": seconds},
                "updates | seconds", "training loss", res["target_loss"], out / name,
                title=f"HetPipe bench ({opt}, D={d}): training loss, target dashed")  # fmt: skip
        names.append(name)
    return names


def _panels(plt: Any, panels: dict[str, Series], xlabel: str, ylabel: str,
            target: float | None, path: Path, *, title: str) -> None:  # fmt: skip
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.3 * rows), squeeze=False,
                             sharey=True)  # fmt: skip
    for ax, (name, series) in zip(axes.flat, panels.items(), strict=False):
        for label, (x, y) in series.items():
            ax.plot(x, y, label=label, linewidth=1.1)
        if target is not None:
            ax.axhline(target, linestyle="--", color="black", linewidth=0.8)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(linewidth=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.supxlabel(xlabel)
    fig.supylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _count(values: list[float]) -> list[float]:
    return [float(i) for i in range(1, len(values) + 1)]


def _y(value: float | None) -> float:
    return math.nan if value is None else float(value)
