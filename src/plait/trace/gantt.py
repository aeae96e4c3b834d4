"""PNG Gantt charts of timelines: one row per rank, coloured by kind, predicted over measured.

Compute spans fill the upper part of a rank's row, labelled with their micro-batch when
wide enough; communication, waits and the optimizer step run in a thin strip beneath, as
they overlap compute. Drawing needs matplotlib (the `plot` extra: `pip install
'plait[plot]'`); it is imported only when a chart is drawn, with the Agg backend, so no
display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.trace.spans import KINDS, Span

__all__ = ["COLORS", "plot_comparison", "plot_timeline"]

#: Colour of each span kind.
COLORS: dict[str, str] = {
    "F": "#4C9BE8",
    "B": "#F28E2B",
    "BI": "#E15759",
    "BW": "#59A14F",
    "comm": "#9C755F",
    "optimizer": "#B07AA1",
    "wait": "#D3D3D3",
}
_STRIP = {"comm", "wait", "optimizer"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "drawing a PNG timeline needs matplotlib, which is not installed: "
            "pip install 'plait[plot]' (or pip install matplotlib), or write a Chrome trace "
            "(JSON) instead"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax: Any, spans: Sequence[Span], title: str, end: float) -> None:
    ranks = sorted({s.rank for s in spans})
    for s in spans:
        strip = s.kind in _STRIP
        y, height = (s.rank + 0.28, 0.2) if strip else (s.rank - 0.4, 0.62)
        ax.broken_barh(
            [(s.start * 1e3, max(s.duration, 0.0) * 1e3)],
            (y, height),
            facecolors=COLORS.get(s.kind, "#999999"),
            edgecolor="white" if not strip else "none",
            linewidth=0.4,
        )
        if not strip and end > 0 and s.duration > 0.02 * end:
            micro = s.label.split(s.kind)[-1] if s.kind in s.label else s.label
            ax.text((s.start + s.duration / 2) * 1e3, s.rank - 0.09, micro, ha="center",
                    va="center", fontsize=6, color="white")  # fmt: skip
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.6, min(ranks, default=0) - 0.6)
    ax.set_xlim(0, end * 1e3 * 1.01 if end > 0 else 1)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", linewidth=0.3)


def _legend(fig: Any, spans: Sequence[Span]) -> None:
    from matplotlib.patches import Patch

    present = [k for k in KINDS if any(s.kind == k for s in spans)]
    handles = [Patch(color=COLORS[k], label=k) for k in present]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=7, frameon=False)


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def plot_timeline(spans: Sequence[Span], path: str | Path, *, title: str = "") -> Path:
    """Draw one timeline as a PNG at `path`; returns the path."""
    plt = _pyplot()
    ranks = len({s.rank for s in spans}) or 1
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.55 * ranks), layout="constrained")
    _draw(ax, spans, title, max((s.end for s in spans), default=0.0))
    ax.set_xlabel("time (ms)")
    _legend(fig, spans)
    return _save(fig, path)


def plot_comparison(
    predicted: Sequence[Span],
    measured: Sequence[Span],
    path: str | Path,
    *,
    title: str = "",
) -> Path:
    """Predicted (top) and measured (bottom) timelines of one run on one time axis."""
    plt = _pyplot()
    ranks = len({s.rank for s in [*predicted, *measured]}) or 1
    fig, axes = plt.subplots(
        2, 1, figsize=(11, 1.4 + 1.1 * ranks), sharex=True, layout="constrained"
    )
    end = max((s.end for s in [*predicted, *measured]), default=0.0)
    p_end = max((s.end for s in predicted), default=0.0)
    m_end = max((s.end for s in measured), default=0.0)
    _draw(axes[0], predicted, f"{title} predicted: {p_end * 1e3:.1f} ms".strip(), end)
    _draw(axes[1], measured, f"{title} measured: {m_end * 1e3:.1f} ms".strip(), end)
    axes[1].set_xlabel("time (ms)")
    _legend(fig, [*predicted, *measured])
    return _save(fig, path)
