"""`plait experiment all`: every seed experiment in one resumable JSON, a Markdown report and
PNG plots (published, predicted at the paper's scale, measured here).

The JSON (`results.json` under the output folder) is rewritten after every measured cell,
so an interrupted run started again with the same folder skips what it already has.
Plots need matplotlib (`pip install 'plait[plot]'`); without it the report says so.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plait.experiment import data_movement as dm
from plait.experiment import dp_vs_gpipe as dg

__all__ = ["Store", "plain", "render_markdown", "run_all"]


def plain(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


class Store:
    """The results JSON: one section per experiment, cells saved as they finish."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def begin(self, section: str, config: Any) -> None:
        """Keep `section`'s cells if they were measured under `config`, else drop them."""
        if self.data.get(section, {}).get("config") not in (None, plain(asdict(config))):
            self.data[section] = {}  # another configuration: its cells do not carry over
        self.data.setdefault(section, {})["config"] = plain(asdict(config))

    def cells(self, section: str) -> dict[str, Any]:
        cells: dict[str, Any] = self.data.setdefault(section, {}).setdefault("measured", {})
        return cells

    def saver(self, section: str) -> Callable[[str, Any], None]:
        def save(key: str, value: Any) -> None:
            self.cells(section)[key] = value
            self.write()

        return save

    def resume(
        self, section: str, config: Any
    ) -> tuple[dict[str, Any], Callable[[str, Any], None]]:
        """`begin` the section under `config`; its cells kept so far, and their saver."""
        self.begin(section, config)
        return self.cells(section), self.saver(section)

    def put(self, section: str, value: dict[str, Any]) -> None:
        self.data[section] = value
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def run_all(out: Path, *, dp: dg.DpGpipeConfig, movement: dm.DataMovementConfig,
            staleness: Any | None, dp_setup: dg.PaperSetup | None = None,
            movement_setup: dm.PaperSetup | None = None, quiet: bool = False,
            measure: bool = True) -> dict[str, Any]:  # fmt: skip
    """Run (or resume) every experiment into `out`; returns the results dict. A section
    measured under another configuration starts afresh."""
    store = Store(out / "results.json")
    done, save = store.resume("dp_vs_gpipe", dp)
    result = dg.run_experiment(dp, dp_setup, run_root=out / "runs", done=done, save=save,
                               quiet=quiet, train=measure)  # fmt: skip
    store.put("dp_vs_gpipe", result)
    done, save = store.resume("data_movement", movement)
    result = dm.run_experiment(movement, movement_setup, done=done, save=save, quiet=quiet,
                               train=measure)  # fmt: skip
    store.put("data_movement", result)
    saved = store.data.get("staleness", {}).get("config", {})
    wanted = plain(asdict(staleness)) if staleness is not None else {}
    wanted.pop("lr", None)  # saved as the rate used, not as asked (None: the default)
    if staleness is not None:  # saved as the optimizer used (None: the regime's)
        wanted["optimizer"] = staleness.optimizer_name
    if staleness is not None and any(saved.get(k) != v for k, v in wanted.items()):
        from plait.experiment import staleness as st

        store.put("staleness", st.run_experiment(staleness, quiet=quiet).to_dict())
    plots = _plots(store.data, out)
    # hand-written text beside the results, so a resumed run does not write over it
    preface, discussion = (_read(out / name) for name in ("preface.md", "discussion.md"))
    (out / "report.md").write_text(render_markdown(store.data, plots, preface=preface,
                                                   discussion=discussion))  # fmt: skip
    if not quiet:
        print(f"experiment all: wrote {out / 'report.md'} and {store.path}", file=sys.stderr)
    return store.data


# ------------------------------------------------------------------ markdown
def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _f(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def _pick(pick: dict[str, Any] | None) -> str:
    if pick is None:
        return "-"
    bound = f"; {pick['bound']}-bound" if "bound" in pick else ""  # results before it
    return f"{pick['seconds']:.1f} ({pick['plan']}{bound})"


def _dp_section(data: dict[str, Any]) -> list[str]:
    c, pred = data["config"], data["predicted"]
    s = pred["setup"]
    lines = ["## Data parallelism vs GPipe (seed 001, Tables 3 and 4)", "",
             f"Predicted at the paper's scale on `{pred['cluster']}`: {s['images']} images × "
             f"{s['epochs']} epochs, batch {s['batch_size']}, GPipe with {s['chunks']} "
             f"micro-batches and recomputation (torchgpipe's checkpointing), an input pipeline "
             f"of {s['loader_samples_per_s']:.0f} samples/s per process and "
             f"{s['dispatch_s'] * 1e6:.0f} µs of host dispatch per operator (assumptions: "
             "the seed states neither). The published fp16 table (Table 4) repeats Table 3's "
             "numbers in the seed. 'implied ms per task': the host time per (micro-batch, "
             "stage) task under which the simulated GPipe run takes the published time.",
             ""]  # fmt: skip
    for dtype, table in pred["tables"].items():
        rows = []
        fit = table.get("task_fit") or {"seconds": [None] * len(table["rows"])}
        for r, fitted in zip(table["rows"], fit["seconds"], strict=True):
            d, g, p = r["ddp"], r["gpipe"], r["plait"]
            task = g.get("implied_task_s")
            rows.append([str(r["gpus"]), _f(d["published_accuracy"]), _f(d["published_s"]),
                         _f(d["seconds"]), _pct(d["error"]), d["bound"],
                         _f(g["published_accuracy"]), _f(g["published_s"]), _f(g["seconds"]),
                         _pct(g["error"]), g["bound"], _f(task and task * 1e3),
                         _f(fitted), _f(p["1f1b"]), _f(p["interleaved"]),
                         _pick(p["planner"])])  # fmt: skip
        med = table["median_error"]
        lines += [f"### Predicted, {dtype} (seconds for the whole run)", ""]
        lines += _table(["GPUs", "DDP acc. % published", "DDP s published", "DDP s predicted",
                         "error", "bound", "GPipe acc. % published", "GPipe s published",
                         "GPipe s predicted", "error", "bound", "implied ms per task",
                         "GPipe s, one task cost", "plait 1F1B", "plait interleaved",
                         "planner's pick"], rows)  # fmt: skip
        lines += [f"Median error: DDP {_pct(med['ddp'])}, GPipe {_pct(med['gpipe'])}"
                  + (f"; GPipe with one task cost for all counts "
                     f"({fit['task_s'] * 1e3:.1f} ms, fitted) {_pct(fit['median_error'])}."
                     if "task_s" in fit else "."), ""]  # fmt: skip
    lines += [f"- {x}" for x in pred["findings"]] + [""]
    rows = []
    for key, cell in sorted(data["measured"].items()):
        method, workers, dtype = key.split("/")
        rows.append([method, workers, dtype, _f(cell["seconds"]), _f(cell["accuracy"]),
                     _f(cell["final_loss"], 3), str(cell.get("partition") or "-")])  # fmt: skip
    lines += ["### Measured here (CPU worker processes)", "",
              f"ResNet-18 of width {c['width']} (64 in the paper) on {c['train_images']} "
              f"{c['data']} images × {c['epochs']} epoch(s), batch {c['batch_size']}, GPipe with "
              f"{c['microbatches']} micro-batches, stages balanced by measured block time; "
              "seconds are the training steps' (start-up and validation excluded).",
              ""]  # fmt: skip
    if not rows:
        return [*lines, "Not measured in this run (`--predict-only`).", ""]
    lines += _table(["method", "workers", "dtype", "seconds", "accuracy %", "final loss",
                     "blocks per stage"], rows)  # fmt: skip
    return lines


def _dm_section(data: dict[str, Any]) -> list[str]:
    c, pred = data["config"], data["predicted"]
    s = pred["setup"]
    lines = ["## Data movement in data parallelism (seed 003, Table 2)", "",
             f"Predicted on `{pred['cluster']}` at batch {s['batch_size']}, "
             f"{s['image_size']}×{s['image_size']} images, nn.DataParallel's step (host copy at "
             f"{s['host_copy_Bps'] / 1e9:.0f} GB/s, an assumption; scatter, weight broadcast "
             "and gradient reduction over PCIe; compute by the simulator, with 3×3 "
             f"convolutions as Winograd at {s.get('winograd', 1.0):g}× less arithmetic).",
             ""]  # fmt: skip
    rows = []
    for r in pred["rows"]:
        pub = r["published"]
        rows.append([r["model"], str(r["gpus"]), "×" if pub is None else f"{pub[0]:.2f}",
                     _f(r["I"], 2), _pct(r["error_I"]), "×" if pub is None else f"{pub[1]:.2f}",
                     _f(r["M"], 2), _pct(r["error_M"]),
                     f"{r['memory_gib']:.1f}" + ("" if r["fits"] else " (×)")])  # fmt: skip
    lines += _table(["model", "GPUs", "I published %", "I predicted %", "error", "M published %",
                     "M predicted %", "error", "memory GiB"], rows)  # fmt: skip
    lines += [f"Median error: {_pct(pred['median_error'])} (I {_pct(pred['median_error_I'])}, "
              f"M {_pct(pred['median_error_M'])}). The simulator's memory check agrees with "
              f"the paper's × (out of memory) in {pred['memory_agreement'][0]} of "
              f"{pred['memory_agreement'][1]} cells.", ""]  # fmt: skip
    rows = []
    for key, cell in sorted(data["measured"].items()):
        model, workers = key.split("/")
        b, r = cell["base"], cell["remedy"]
        rows.append([model, workers, _f(b["I"]), _f(b["M"]), _f(b["step_s"] * 1e3),
                     _f(r["I"]), _f(r["M"]), _f(r["step_s"] * 1e3)])  # fmt: skip
    lines += ["### Measured here (CPU worker processes)", "",
              f"Width ×{c['width_mult']}, {c['image_size']}×{c['image_size']} images, batch "
              f"{c['batch_size']} split over the workers, median of {c['steps']} steps. Remedies: "
              "per-worker input built one step ahead in a background thread, fp16 gradient "
              "all-reduce.", ""]  # fmt: skip
    if not rows:
        return [*lines, "Not measured in this run (`--predict-only`).", ""]
    lines += _table(["model", "workers", "I %", "M %", "step ms", "I % (remedies)",
                     "M % (remedies)", "step ms (remedies)"], rows)  # fmt: skip
    return lines


def _staleness_section(data: dict[str, Any]) -> list[str]:
    cfg = data["config"]
    stages = cfg["stages"]
    lines = [
        "## Staleness: epochs to a target (seed 003, §4)",
        "",
        f"Target validation loss {data['target']:.4f}; '-': not reached.",
        "",
    ]
    rows = []
    for kind in cfg["schedules"]:
        runs = {r["stages"]: r for r in data["runs"] if r["schedule"] == kind}
        rows.append([kind, *(_f(runs[p]["epochs_to_target"], 2) if p in runs else "-"
                             for p in stages)])  # fmt: skip
    lines += _table(["schedule", *(f"p={p}" for p in stages)], rows)
    return lines + [f"- {x}" for x in data["findings"]] + [""]


def render_markdown(data: dict[str, Any], plots: list[str] | str, *, preface: str = "",
                    discussion: str = "") -> str:  # fmt: skip
    """The report: one section per experiment, then the plots (or why there are none);
    `preface` and `discussion` are text written by hand, kept across runs."""
    lines = ["# The seeds' experiments: published, predicted at the papers' scale, measured "
             "here", ""]  # fmt: skip
    if preface.strip():
        lines += [preface.strip(), ""]
    render = {"dp_vs_gpipe": _dp_section, "data_movement": _dm_section,
              "staleness": _staleness_section}  # fmt: skip
    for section, write in render.items():
        if _complete(data, section):
            lines += write(data[section])
        elif section in data:
            lines += _incomplete(section, data[section])
    lines += ["## Plots", ""]
    if isinstance(plots, str):
        lines += [plots, ""]
    else:
        lines += [f"![{p}]({p})" for p in plots] + [""]
    if discussion.strip():
        lines += ["## Discussion", "", discussion.strip(), ""]
    return "\n".join(lines)


# a section is written whole when its experiment finishes; until then (a run stopped with
# Ctrl-C, or only another experiment run into the same folder) it holds its measured cells
_FINISHED_BY = {"dp_vs_gpipe": "predicted", "data_movement": "predicted", "staleness": "runs"}
_SECTIONS = {"dp_vs_gpipe": ("Data parallelism vs GPipe", "dp-vs-gpipe"),
             "data_movement": ("Data movement in data parallelism", "data-movement"),
             "staleness": ("Staleness", "staleness")}  # fmt: skip


def _complete(data: dict[str, Any], section: str) -> bool:
    return _FINISHED_BY[section] in data.get(section, {})


def _incomplete(section: str, data: dict[str, Any]) -> list[str]:
    """The heading of a section its experiment has not finished, and how to finish it."""
    title, command = _SECTIONS[section]
    cells = len(data.get("measured", {}))
    return [f"## {title}: incomplete", "",
            f"Not finished: the {cells} cell(s) measured so far are kept in results.json; "
            f"run `plait experiment {command} --out DIR` again with this folder and the same "
            "flags to finish it.", ""]  # fmt: skip


# ------------------------------------------------------------------ plots
def _plots(data: dict[str, Any], out: Path) -> list[str] | str:
    try:
        from plait.experiment.staleness_plot import require_matplotlib

        plt = require_matplotlib()
    except RuntimeError:
        return "No plots: matplotlib is not installed (pip install 'plait[plot]')."
    names = []
    if _complete(data, "dp_vs_gpipe"):
        rows = data["dp_vs_gpipe"]["predicted"]["tables"]["fp32"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        g = [r["gpus"] for r in rows]
        for method, color in (("ddp", "C0"), ("gpipe", "C1")):
            ax.plot(g, [r[method]["published_s"] for r in rows], "o-", color=color,
                    label=f"{method} published")  # fmt: skip
            ax.plot(g, [r[method]["seconds"] for r in rows], "s--", color=color,
                    label=f"{method} predicted")  # fmt: skip
        ax.set_xlabel("A100 GPUs")
        ax.set_ylabel("seconds, 10 epochs")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title("seed 001 Table 3: DDP vs GPipe", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "dp_vs_gpipe.png", dpi=110)
        plt.close(fig)
        names.append("dp_vs_gpipe.png")
    if _complete(data, "data_movement"):
        names.append(_movement_plot(plt, data["data_movement"]["predicted"]["rows"], out))
    dp_cells = data.get("dp_vs_gpipe", {}).get("measured", {})
    dm_cells = data.get("data_movement", {}).get("measured", {})
    if dp_cells and dm_cells:
        names.append(_measured_plot(plt, dp_cells, dm_cells, out))
    if _complete(data, "staleness"):
        names.append(_staleness_plot(plt, data["staleness"], out))
    return names


def _movement_plot(plt: Any, rows: list[dict[str, Any]], out: Path) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    for ax, key, index in ((axes[0], "I", 0), (axes[1], "M", 1)):
        for n, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
            mine = [r for r in rows if r["model"] == model]
            ax.plot([r["gpus"] for r in mine], [r[key] for r in mine], "--", color=f"C{n}")
            pub = [(r["gpus"], r["published"][index]) for r in mine if r["published"]]
            if pub:
                ax.plot(*zip(*pub, strict=True), "o-", color=f"C{n}", label=model)
        ax.set_title(f"{key} share (solid: published, dashed: predicted)", fontsize=8)
        ax.set_xlabel("GPUs")
    axes[0].set_ylabel("% of step time")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "data_movement.png", dpi=110)
    plt.close(fig)
    return "data_movement.png"


def _measured_plot(plt: Any, dp_cells: dict[str, Any], dm_cells: dict[str, Any],
                   out: Path) -> str:  # fmt: skip
    """Measured here: seconds of each training run; I + M shares without and with remedies."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    keys = sorted(dp_cells)
    axes[0].bar(range(len(keys)), [dp_cells[k]["seconds"] for k in keys],
                color=["C0" if k.startswith("ddp") else "C1" for k in keys])  # fmt: skip
    axes[0].set_xticks(range(len(keys)), keys, rotation=45, ha="right", fontsize=7)
    axes[0].set_ylabel("training seconds here (log)")
    axes[0].set_yscale("log")  # CPU fp16 is emulated: 10-20× fp32
    axes[0].set_title("ResNet-18 here: DDP (blue) vs GPipe (orange)", fontsize=9)
    keys = sorted(dm_cells)
    x = range(len(keys))
    for offset, variant, color in ((-0.2, "base", "C3"), (0.2, "remedy", "C2")):
        i = [dm_cells[k][variant]["I"] for k in keys]
        m = [dm_cells[k][variant]["M"] for k in keys]
        axes[1].bar([v + offset for v in x], i, width=0.4, color=color, label=f"I ({variant})")
        axes[1].bar([v + offset for v in x], m, width=0.4, bottom=i, color=color, alpha=0.45,
                    label=f"M ({variant})")  # fmt: skip
    axes[1].set_xticks(list(x), keys, rotation=45, ha="right", fontsize=7)
    axes[1].set_ylabel("% of step time here")
    axes[1].legend(fontsize=7)
    axes[1].set_title("data movement here: baseline vs remedies", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "measured.png", dpi=110)
    plt.close(fig)
    return "measured.png"


def _staleness_plot(plt: Any, data: dict[str, Any], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    kinds = data["config"]["schedules"]
    for n, kind in enumerate(kinds):
        runs = [r for r in data["runs"] if r["schedule"] == kind]
        xs = [r["stages"] for r in runs]
        ys = [r["epochs_to_target"] for r in runs]
        ax.plot(xs, [y if y is not None else float("nan") for y in ys], "o-", color=f"C{n}",
                label=kind)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pipeline stages")
    ax.set_ylabel("epochs to target")
    ax.legend(fontsize=7)
    ax.set_title("seed 003 §4: epochs to a target per depth", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=110)
    plt.close(fig)
    return "staleness.png"
