"""What `plait simulate` shows of a prediction: the JSON summary, the table, the lines
saying what does not fit, and the trace and plot files."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.cluster import Cluster
    from plait.plan.predict import Prediction
    from plait.profile.analytic import GPTSpec
    from plait.sim import RankReport, SimResult
    from plait.sim.result import MemoryOverflow

__all__ = ["overflow_lines", "print_summary", "to_dict", "write_outputs"]

_GIB = float(1 << 30)


def overflow_lines(result: SimResult) -> list[str]:
    """What does not fit, one line per pipeline rank (worst first), and what to try."""
    by_stage: dict[int, list[MemoryOverflow]] = {}
    for o in result.overflows:
        by_stage.setdefault(o.pp_rank, []).append(o)
    lines = ["plait simulate: the plan does not fit in device memory:"]
    for items in sorted(by_stage.values(), key=lambda os: -os[0].excess_bytes):
        o, ranks = items[0], [x.rank for x in items]
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"
        lines.append(
            f"  {where} (pipeline rank {o.pp_rank}) need {o.needed_bytes / _GIB:.2f} GiB each "
            f"but have {o.capacity_bytes / _GIB:.2f} GiB: {o.excess_bytes / _GIB:.2f} GiB over"
        )
    lines.append(
        "  try --recompute full or selective, --zero 1..3 with --dp > 1, more --pp, --tp or --cp, "
        "a smaller --micro-batch-size, or a schedule holding fewer micro-batches (1f1b)"
    )
    return lines


def _span(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def write_outputs(args: argparse.Namespace, prediction: Prediction) -> None:
    if not (args.trace or args.plot):
        return
    from plait.trace import plot_timeline, spans_from_timeline, write_chrome_trace

    spans = spans_from_timeline(prediction.result.timeline)
    if args.trace:
        write_chrome_trace(args.trace, {"predicted": spans})
    if args.plot:
        plan = prediction.result.plan
        title = f"{plan.schedule}: pp={plan.pp}, {plan.microbatches} micro-batches"
        plot_timeline(spans, args.plot, title=title)


def to_dict(prediction: Prediction, spec: GPTSpec) -> dict[str, Any]:
    """The JSON summary of a prediction."""
    r, cluster = prediction.result, prediction.cluster
    group = cluster.groups[0]
    return {
        "step_time_s": r.step_time_s,
        "pipeline_time_s": r.pipeline_time_s,
        "bubble_fraction": r.bubble_fraction,
        "tokens_per_s": r.tokens_per_s,
        "samples_per_s": r.samples_per_s,
        "mfu": r.mfu,
        "comm_share": r.comm_share,
        "all_to_all_share": r.all_to_all_share,
        "ep_comm_s": [rank.ep_comm_s for rank in r.ranks],  # per pipeline rank
        "cp": r.plan.cp,
        "cp_comm_s": [rank.cp_comm_s for rank in r.ranks],  # per pipeline rank
        "peak_memory_bytes": list(r.peak_memory_bytes),  # per pipeline rank
        "fits": r.fits,
        "overflows": [
            {**asdict(o), "excess_bytes": o.excess_bytes, "message": str(o)} for o in r.overflows
        ],
        "memory": [_memory_row(k) for k in r.ranks],
        "ranks": [{k: v for k, v in asdict(rank).items() if k != "memory"} for rank in r.ranks],
        "partition": {
            "sizes": list(prediction.partition.sizes),
            "boundaries": list(prediction.partition.boundaries),
        },
        "plan": r.plan.to_dict(),
        "codec": _codec_row(r.plan.compress, cluster),
        "model": _model_row(spec),
        "cluster": {
            "name": cluster.name,
            "num_nodes": cluster.num_nodes,
            "devices_per_node": group.devices_per_node,
            "device": group.device.name,
        },
    }


def _codec_row(compress: str, cluster: Cluster) -> dict[str, Any] | None:
    """Where the encode/decode time of the gradient compression comes from."""
    from plait.cost.compress import codec_figure, codec_source

    if compress == "none":
        return None
    device = cluster.device(0)
    measured = codec_figure(compress, device.codec_s_per_entry)
    return {
        "source": "measured" if measured else "analytic",
        "s_per_entry": measured[0] if measured else None,
        "text": codec_source(compress, device),
    }


def _memory_row(rank: RankReport) -> dict[str, Any]:
    return {
        "pp_rank": rank.pp_rank,
        **asdict(rank.memory),
        "total": rank.memory.total,
        "capacity": rank.capacity_bytes,
    }


def _model_row(spec: GPTSpec) -> dict[str, Any]:
    row: dict[str, Any] = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    row["num_params"] = spec.num_params()
    return row


def print_summary(summary: dict[str, Any]) -> None:
    from rich.table import Table

    from plait.console import console as make_console
    from plait.console import size

    plan, c = summary["plan"], summary["cluster"]
    console = make_console()
    console.print(
        f"[bold]{plan['schedule']}[/]: dp={plan['dp']} tp={plan['tp']} pp={plan['pp']} "
        f"({plan['chunks']} chunk(s)), {plan['microbatches']} micro-batches of "
        f"{plan['micro_batch_size']}, recompute {plan['recompute']}, ZeRO-{plan['zero']}, "
        f"{plan['dtype']} on {c['num_nodes']} × {c['name']} ({c['device']})"
    )
    console.print(
        f"step {summary['step_time_s']:.4g} s | bubble {summary['bubble_fraction']:.1%} | "
        f"{summary['tokens_per_s']:,.0f} tokens/s | MFU {summary['mfu']:.1%} | "
        f"{'fits' if summary['fits'] else '[red]DOES NOT FIT[/]'}"
    )
    table = Table(title="memory per pipeline rank")
    for column in ("rank", "params", "grads", "optimizer", "activations", "transient",
                   "total", "capacity"):  # fmt: skip
        table.add_column(column, justify="right")
    for m in summary["memory"]:
        keys = ("params", "grads", "optimizer", "activations", "transient", "total", "capacity")
        style = "red" if m["total"] > m["capacity"] else None
        table.add_row(str(m["pp_rank"]), *(size(m[k]) for k in keys), style=style)
    console.print(table)
    console.print(f"blocks per stage: {summary['partition']['sizes']}")
    if plan["ep"] > 1:
        console.print(
            f"expert all-to-all: {max(summary['ep_comm_s']):.4g} s per step on the busiest "
            f"rank, {summary['all_to_all_share']:.1%} of the step (ep={plan['ep']})"
        )
    if summary["codec"] is not None:
        console.print(f"{plan['compress']} encode/decode: {summary['codec']['text']}")
