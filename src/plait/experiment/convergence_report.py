"""`convergence.md` and its PNGs from the results of `plait experiment convergence`: the
seeds' and papers' figures beside plait's, the checks the issue names, and the curves.

Plots need matplotlib (`pip install 'plait[plot]'`); without it the report says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["PAPERS", "checks", "write_report"]

# what the seeds and papers report, as they state it (the figures plait's sit beside)
PAPERS = {
    "staleness": [
        "Seed 003 §4 (simulated, ResNet on CIFAR-class data): 16 GPUs needed 52 epochs to 40% "
        "top-1 where 1 GPU needed 30 (1.73×); it adds that no weight prediction method matches "
        "synchronous training.",
        "PipeDream (Narayanan et al., SOSP 2019): up to 5.3× faster to a target accuracy than "
        "data parallelism; weight stashing needed to converge. SpecTrain's PyTorch port "
        "(CIFAR-10, VGG-16, 100 epochs): 91.10% top-1 with data parallelism on 2 GPUs, 88.91% "
        "with PipeDream on 4 stages, 89.38% with SpecTrain (v2) on 4.",
        "SpecTrain (Chen et al. 2018) and XPipe (Guan et al. 2019): accuracy close to "
        "synchronous training with weight prediction (XPipe: 'comparable, even slightly "
        "better'). PipeDream-2BW (Narayanan et al., ICML 2021): 'similar final model accuracy'.",
    ],
    "compress": [
        "Seed 000 (Ström, Interspeech 2015): communication reduced 'by as much as three orders "
        "of magnitude' without accuracy loss.",
        "Deep Gradient Compression (Lin et al., ICLR 2018): 270× to 600× smaller gradients "
        "without losing accuracy (ResNet-50 97 MB → 0.35 MB), with momentum correction, local "
        "gradient clipping, momentum factor masking and a sparsity warm-up.",
    ],
    "wsp": [
        "HetPipe (Park et al., USENIX ATC 2020; seed 000): DNN models converge up to 49% faster "
        "than the state-of-the-art data parallelism on heterogeneous GPUs, and WSP converges "
        "to the synchronous accuracy.",
    ],
}


def write_report(data: dict[str, Any], out: Path) -> Path:
    """Write `convergence.md` (and its PNGs) for `data` into `out`."""
    from plait.experiment.convergence_plots import draw

    out.mkdir(parents=True, exist_ok=True)
    plots = draw(data, out)
    lines = [
        "# Convergence: the seeds' claims, measured",
        "",
        "Written by `plait experiment convergence --out docs/experiments` (settings and "
        "raw curves in `convergence.json`). Every number below is measured on this "
        "machine's CPUs; every curve of the staleness sections comes from plait's "
        "one-process emulator, which `tests/dist/test_convergence_runtime.py` holds to "
        "`plait train`'s real workers (equal losses at 1e-5, fp32, one configuration of "
        "each method), and the compression and WSP curves are real distributed runs.",
        "",
    ]
    if "error" in plots:
        lines += [f"(No plots: {plots['error']})", ""]
    for section, title in (
        ("image", "Stale pipelines, the papers' regime: a CNN with SGD"),
        ("gpt", "Stale pipelines, the GPT regime: AdamW"),
        ("compress", "Gradient compression: 100× fewer bytes"),
        ("wsp", "HetPipe: WSP and heterogeneous plans"),
    ):
        if section in data:
            lines += [f"## {title}", "", *_section(section, data[section], plots)]
    discussion = out / "convergence-discussion.md"
    if discussion.is_file():
        lines += ["## Discussion", "", discussion.read_text().strip(), ""]
    path = out / "convergence.md"
    path.write_text("\n".join(lines))
    return path


def _section(section: str, result: dict[str, Any], plots: dict[str, Any]) -> list[str]:
    lines = ["What the seeds and papers report:", ""]
    lines += [f"- {p}" for p in PAPERS["staleness" if section in ("image", "gpt") else section]]
    lines += ["", "What plait measured:", ""]
    body = {"image": _staleness, "gpt": _staleness, "compress": _compress, "wsp": _wsp}[section]
    lines += body(result)
    lines += ["Checks:", ""] + [f"- {c}" for c in checks(section, result)] + [""]
    for name in plots.get(section, []):
        lines += [f"![{section}]({name})", ""]
    return lines


# ------------------------------------------------------------------ staleness
def _epochs(run: dict[str, Any] | None) -> float | None:
    return None if run is None else run["epochs_to_target"]


def _find(result: dict[str, Any], kind: str, p: int) -> dict[str, Any] | None:
    return next((r for r in result["runs"] if (r["schedule"], r["stages"]) == (kind, p)), None)


def _staleness(result: dict[str, Any]) -> list[str]:
    main = result["main"]
    c = main["config"]
    what = "top-1 accuracy" if main["metric"] == "val_accuracy" else "loss"
    budget = max(r["curve"][-1]["epochs"] for r in main["runs"])
    lines = [
        f"{c['regime']} regime: {c['optimizer']} at lr {c['lr']:g}, {c['micro_batch_size']} "
        f"samples per update for every kind ({c['num_microbatches']} micro-batches per "
        f"window), a budget of {budget:.1f} epochs; target: validation {what} "
        f"{main['target']:.4f}. Epochs to the target ('-': not within the budget):",
        "",
    ]
    stages = c["stages"]
    rows = [[k] + [_f(_epochs(_find(main, k, p))) for p in stages] for k in c["schedules"]]
    lines += _table(["kind", *(f"p={p}" for p in stages)], rows)
    for remedy, res in result["remedies"].items():
        p = res["config"]["stages"][0]
        row = [f"{remedy}"] + [_f(_epochs(_find(res, k, p))) for k in res["config"]["schedules"]]
        lines += [f"With the remedy `{remedy}`, at p={p} (same target):", ""]
        lines += _table(["remedy", *res["config"]["schedules"]], [row])
    return lines + [f"- {line}" for line in main["findings"]] + [""]


def _staleness_checks(result: dict[str, Any]) -> list[str]:
    main = result["main"]
    p = max(s for s in main["config"]["stages"] if s <= 4)
    sync, pd = _epochs(_find(main, "1f1b", p)), _epochs(_find(main, "pipedream", p))
    if sync is None:
        return [f"the synchronous run never reached its own target: no check at p={p}"]
    if pd is None:
        budget = max(r["curve"][-1]["epochs"] for r in main["runs"])
        verdict = (
            "not within 2× (**fails**)"
            if budget >= 2 * sync
            else f"the budget is {budget / sync:.2f}× that, so within 2× is not decided "
            "(**not shown**)"
        )
        out = [
            f"PipeDream (weight stashing) at p={p} did not reach the target within the "
            f"budget of {budget:.2f} epochs (best {_best(main, _find(main, 'pipedream', p))}; "
            f"synchronous: {sync:.2f} epochs): {verdict}"
        ]
    else:
        ok = "holds" if pd <= 2 * sync else "**fails**"
        out = [
            f"PipeDream at p={p}: {pd:.2f} epochs against the synchronous {sync:.2f}"
            f"{_times(pd, sync)}: within 2× {ok}"
        ]
    for kind in (k for k in ("spectrain", "xpipe") if k in main["config"]["schedules"]):
        run = _find(main, kind, p)
        out.append(_recovered(kind, _epochs(run), pd, sync, _unless(main, run)))
    for remedy, res in result["remedies"].items():
        run = _find(res, "pipedream", res["config"]["stages"][0])
        e = _epochs(run)
        shown = (
            f"not reached{_unless(res, run)}" if e is None else f"{e:.2f} epochs{_times(e, sync)}"
        )
        out.append(f"PipeDream at p={p} with `{remedy}`: {shown}")
    return out


def _best(result: dict[str, Any], run: dict[str, Any] | None) -> str:
    if run is None:
        return "-"
    if result["metric"] == "val_accuracy":
        return f"top-1 {run['best_val_accuracy']:.4f} against {result['target']:.4f}"
    return f"loss {run['best_val_loss']:.3f} against {result['target']:.3f}"


def _unless(result: dict[str, Any], run: dict[str, Any] | None) -> str:
    """The best a run that missed the target reached ('' for one that reached it)."""
    return "" if run is None or _epochs(run) is not None else f" (best {_best(result, run)})"


def _recovered(kind: str, e: float | None, pd: float | None, sync: float, best: str) -> str:
    if e is None and pd is None:
        return f"{kind}: neither it nor PipeDream reached the target in the budget{best}: not shown"
    if e is None:
        none = "recovers none of PipeDream's extra epochs (**fails**)"
        return f"{kind}: did not reach the target{best}; {none}"
    if pd is None:
        return (
            f"{kind}: {e:.2f} epochs where PipeDream did not reach the target in the "
            "budget: recovers at least half of PipeDream's extra epochs (holds)"
        )
    if pd <= sync:
        return f"{kind}: {e:.2f} epochs; PipeDream needed no extra epochs to recover"
    share = (pd - e) / (pd - sync)
    ok = "holds" if share >= 0.5 else "**fails**"
    return (
        f"{kind}: {e:.2f} epochs, {100 * share:.0f}% of PipeDream's extra epochs recovered ({ok})"
    )


# ------------------------------------------------------------------ compression
def _compress(result: dict[str, Any]) -> list[str]:
    res = result["result"]
    c = res["config"]
    lines = [
        f"A {c['num_layers']}-layer GPT (hidden {c['hidden']}) for {c['num_steps']} steps of "
        f"{c['optimizer']} at lr {c['lr']:g}, batch {c['batch_size']}; 'fewer bytes' is the "
        "fp32 all-reduce's bytes over the method's in the steady state (whole run: every "
        "step's, warm-ups included); loss: the mean of the last 5 steps, over none's.",
        "",
    ]
    for w, per in res["workers"].items():
        rows = [
            [
                m,
                _f(1 / r["bytes_vs_none"], 0),
                _f(1 / r["bytes_vs_none_total"], 0),
                _f(r["loss"], 3),
                _f(r["loss_vs_none"], 3),
            ]
            for m, r in per["methods"].items()
        ]
        lines += [f"{w} workers:", ""]
        lines += _table(
            ["method", "fewer bytes", "fewer bytes, whole run", "loss", "vs none"], rows
        )
    return lines


def _compress_checks(result: dict[str, Any]) -> list[str]:
    out = []
    for w, claim in result["result"]["claim"].items():
        if claim["method"] is None:
            out.append(f"{w} workers: {claim['why']} (**fails**)")
            continue
        ok = "holds" if claim["within_2_percent"] else "**fails**"
        out.append(
            f"{w} workers: the method with ≥ 100× fewer bytes and the lowest loss is "
            f"`{claim['method']}`, {claim['fewer_bytes']:.0f}× fewer bytes "
            f"({claim['fewer_bytes_with_warmup']:.0f}× over the whole run), loss "
            f"{claim['loss_vs_none']:.3f}× none's: within 2% {ok}"
        )
    return out


# ------------------------------------------------------------------ WSP
def _wsp(result: dict[str, Any]) -> list[str]:
    lines = []
    for res in result["results"]:
        c = res["config"]
        lines += [
            f"{c['workers']} workers, {c['slow']} of them {c['slowdown']:g}× slower; "
            f"{c['optimizer']} at lr {c['lr']:g}, {c['steps']} steps, WSP D="
            f"{c['staleness']}; target loss {res['target_loss']:.3f} (equal dp's at "
            f"{c['target_at']:g} of its steps):",
            "",
        ]
        rows = [
            [
                name,
                _f(res[name]["samples_per_s"]),
                _f(res[name]["updates_to_target"], 0),
                _f(res[name]["seconds_to_target"], 2),
                _f(res[name]["final_loss"], 3),
            ]
            for name in ("equal_dp", "hetero_sync", "wsp")
        ]
        lines += _table(
            ["configuration", "samples/s", "updates to target", "seconds to target", "final loss"],
            rows,
        )
    return lines


def _wsp_checks(result: dict[str, Any]) -> list[str]:
    out = []
    for res in result["results"]:
        opt = f"{res['config']['optimizer']}, D={res['config']['staleness']}"
        wsp = res["wsp"]
        reach = (
            f"reaches the target after {wsp['updates_to_target']} updates (holds)"
            if wsp["updates_to_target"]
            else "does not reach the target within the steps (**fails**)"
        )
        best = res["speedup_vs_equal_dp"]
        fast = (
            "no configuration reached it"
            if best is None
            else f"the best heterogeneous configuration reaches it {best:.2f}× sooner than "
            f"equal dp ({'holds' if best >= 1.3 else '**fails**'} ≥ 1.3×)"
        )
        out.append(f"{opt}: WSP {reach}; {fast}")
    return out


def checks(section: str, result: dict[str, Any]) -> list[str]:
    """The issue's checks for `section`, each a sentence ending in whether it holds."""
    if section in ("image", "gpt"):
        return _staleness_checks(result)
    return _compress_checks(result) if section == "compress" else _wsp_checks(result)


# ------------------------------------------------------------------ helpers
def _times(a: float, b: float) -> str:
    return f" ({a / b:.2f}×)" if b > 0 else ""


def _f(x: float | None, digits: int = 2) -> str:
    return (
        "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"
    )


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows] + [""]
