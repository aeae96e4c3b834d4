"""`plait simulate`: predict one training step of a layout before running it.

The model's blocks come from the analytic cost model (`plait.cost.transformer_block_costs`,
so GPT-3 175B or 1T cost nothing to describe), are cut into pp × chunks stages by the
partitioner (the fastest split whose stages fit memory; if none fits, the fastest split,
and the overflow is reported), and the schedule is replayed on the cluster by
`plait.sim.simulate`. A preset describes one kind of node: the number of nodes follows
from dp × tp × pp. A plan that does not fit is a prediction, not an error: the command
says which rank overflows by how much (stderr and the JSON `overflows`) and exits 0.
`--model moe-gpt` is costed by `plait.cost.moe_block_costs`; `--ep` spreads its experts
over ep of the dp × tp ranks, and the JSON gains each rank's all-to-all seconds (`ep_comm_s`)
and their share of the step (`all_to_all_share`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any

from plait.cli.experts import check_ep, model_value
from plait.cli.options import add_config_flags
from plait.cli.plan import check_out
from plait.cli.profile import add_model_arguments, default_dtype, spec_from_args
from plait.cli.simulate_wsp import check_wsp, print_wsp, wsp_summary
from plait.cluster import Cluster, load_cluster, normalize_dtype
from plait.config import ParallelPlan
from plait.cost import RECOMPUTE_MODES, BlockCost, StageCost
from plait.layout import resolve_dp
from plait.plan import Partition, partition, partition_blocks
from plait.profile import GPTSpec
from plait.schedule import KINDS, Schedule, schedule_kind, validate
from plait.sim import MemoryOverflow, RankReport, SimPlan, SimResult, build_schedule, simulate

__all__ = ["Prediction", "add_parser", "overflow_lines", "predict", "scaled_cluster", "to_dict"]

_GIB = float(1 << 30)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="predict step time, bubble, throughput, MFU and memory of a layout",
        description=(__doc__ or "").split("\n\n")[1],
    )
    add_model_arguments(p)
    a = p.add_argument
    a("--cluster", help="preset (local-cpu, dgx-a100-80gb, dgx-h100) or TOML file")
    a(
        "--plan",
        help="a plan file (`plait plan --out`): its layout, batch, model and cluster "
        "replace the flags",
    )
    a("--dp", type=int, default=1, help="data-parallel degree")
    # the data-parallel axes, generated from the plan's fields as `plait train`'s are
    add_config_flags(p, ParallelPlan, skip=_NOT_GENERATED)
    a("--tp", type=int, default=1, help="tensor-parallel degree")
    a("--ep", type=int, default=1,
      help="expert-parallel degree (moe-gpt): experts over ep of the dp × tp ranks")  # fmt: skip
    a("--pp", type=int, default=1, help="pipeline-parallel degree")
    a("--schedule", choices=list(KINDS), default="1f1b", help="pipeline schedule")
    a("--microbatches", type=int, default=1, help="micro-batches per step and replica")
    a("--chunks", type=int, default=None, help="virtual stages per rank (interleaved: 2)")
    a("--recompute", choices=RECOMPUTE_MODES, default="none", help="activation recomputation")
    a("--sequence-parallel", action="store_true", dest="sequence_parallel")
    a("--zero", type=int, default=0, help="ZeRO stage 0..3 over the data-parallel ranks")
    a("--dtype", default=default_dtype(), help=f"training dtype (default {default_dtype()})")
    a("--optimizer", choices=("adam", "sgd"), default="adam")
    a("--compress", default="none", metavar="METHOD",
      help="gradient compression of the dp reduction: none, fp16, bf16, powersgd:RANK, "
      "threshold:TAU, topk:RATIO, sign or dgc:RATIO")  # fmt: skip
    a(
        "--offload-activations",
        default="none",
        metavar="BLOCKS",
        dest="offload_activations",
        help="blocks whose saved activations go to host memory: none, all or indices 1,2",
    )
    a("--offload-optimizer", action="store_true", dest="offload_optimizer",
      help="optimizer state in host memory outside the step")  # fmt: skip
    a("--profile", help="a profile `plait profile --json` wrote: its measured encode/decode "
      "times of --compress replace the estimate from memory bandwidth")  # fmt: skip
    a(
        "--wsp-staleness",
        type=int,
        default=None,
        metavar="D",
        help="Wave Synchronous "
        "Parallel: replay the dp virtual workers' waves under staleness D (plait.cli.simulate_wsp)",
    )
    a("--wsp-wave", type=int, default=1, metavar="N", help="steps per WSP wave")
    a("--json", action="store_true", help="print one JSON object")
    a("--trace", help="write the predicted timeline as a Chrome/Perfetto trace (JSON)")
    a("--plot", help="draw the predicted timeline as a PNG (needs matplotlib)")
    p.set_defaults(func=run, pipelines=None)


@dataclass(frozen=True)
class Prediction:
    """A simulated step and how it was set up."""

    result: SimResult
    partition: Partition
    schedule: Schedule
    cluster: Cluster


def scaled_cluster(cluster: Cluster, num_devices: int) -> Cluster:
    """`cluster` with enough nodes of its kind for `num_devices` ranks."""
    if len(cluster.groups) == 1:
        per_node = cluster.groups[0].devices_per_node
        return cluster.with_nodes(max(1, math.ceil(num_devices / per_node)))
    if cluster.num_devices < num_devices:
        raise ValueError(
            f"dp × tp × pp = {num_devices} ranks but cluster {cluster.name!r} has "
            f"{cluster.num_devices} devices: add nodes to its file or shrink the plan"
        )
    return cluster


def _inflight(schedule: Schedule) -> list[int]:
    """Micro-batches each stage holds at its peak (unit costs), for the memory caps."""
    peak = validate(schedule).peak_inflight
    v = schedule.num_chunks
    return [max(1, math.ceil(peak[r] / v)) for r in schedule.stage_to_rank]


def _partition(
    blocks: list[BlockCost], schedule: Schedule, cluster: Cluster, plan: SimPlan
) -> Partition:
    """The fastest split whose stages fit; if none fits, the fastest split. A split into
    model parts, each placed as its first replica (a stage per part unless replicated)."""
    first = [schedule.replicas(k)[0] for k in range(schedule.num_parts)]
    devices = [cluster.device(plan.global_rank(schedule.stage_to_rank[s])) for s in first]
    inflight = _inflight(schedule)
    try:
        return partition_blocks(
            blocks,
            devices,
            dtype=plan.dtype,
            recompute=plan.recompute,
            inflight=[inflight[s] for s in first],
            layout=plan,
            optimizer=plan.optimizer,
        )
    except ValueError:
        work = [
            b.forward_flops
            + b.backward_input_flops
            + b.backward_weight_flops
            + b.recompute_flops(plan.recompute)
            for b in blocks
        ]
        speeds = [d.achievable_flops(plan.dtype) for d in devices]
        return partition(work, len(devices), speeds=speeds)


def predict(blocks: list[BlockCost], cluster: Cluster, plan: SimPlan) -> Prediction:
    """Partition `blocks` into the plan's stages and simulate one step on `cluster`."""
    schedule = build_schedule(plan)
    if len(blocks) < schedule.num_parts:
        raise ValueError(
            f"pp × chunks = {schedule.num_parts} stages but the model has only {len(blocks)} "
            "blocks: use fewer pipeline ranks or chunks, or more layers"
        )
    cut = _partition(blocks, schedule, cluster, plan)
    stages = [StageCost(tuple(s)) for s in cut.split(blocks)]
    result = simulate(schedule, stages, cluster, plan)
    return Prediction(result, cut, schedule, cluster)


def _check(args: argparse.Namespace, spec: GPTSpec) -> None:
    for name in ("dp", "tp", "pp", "ep", "microbatches"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name} {value} must be >= 1")
    if args.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {args.zero} must be 0, 1, 2 or 3")
    if args.zero and args.dp == 1:  # as `plait train` refuses it
        raise ValueError(f"--zero {args.zero} with --dp 1 does nothing: set --dp > 1 or --zero 0")
    if args.sequence_parallel and args.tp == 1:
        raise ValueError("--sequence-parallel needs --tp > 1: set --tp or drop it")
    if args.compress != "none" and args.dp == 1:  # as `plait train` refuses it
        raise ValueError(f"--compress {args.compress} with --dp 1: no reduction to compress")
    check_ep(args, spec)
    dtype = normalize_dtype(args.dtype)
    why = schedule_kind(args.schedule).unsupported(tp=args.tp, zero=args.zero, dtype=dtype)
    if why is not None:  # what `plait train` cannot run is no layout to predict
        raise ValueError(f"--schedule {args.schedule} {why}")
    for flag, path in (("--trace", args.trace), ("--plot", args.plot)):
        if path:  # checked now, not after simulating
            check_out(path, flag)
    for flag, size in (("--heads", spec.num_heads), ("--hidden", spec.hidden)):
        if size % args.tp:
            raise ValueError(
                f"--tp {args.tp} does not divide {flag} {size}: tensor parallelism splits "
                "heads and hidden units evenly; choose a tp that divides both"
            )
    if spec.ffn % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the MLP width {spec.ffn}: change --tp")
    if args.sequence_parallel and spec.seq_len % args.tp:
        raise ValueError(
            f"--sequence-parallel needs --seq-len {spec.seq_len} divisible by --tp {args.tp}"
        )
    if args.chunks is not None and args.chunks < 1:
        raise ValueError(f"--chunks {args.chunks} must be >= 1")
    try:
        stages = args.pp * schedule_kind(args.schedule).chunks(args.chunks)
    except ValueError as err:
        raise ValueError(f"--chunks {args.chunks}: {err}") from None
    if stages > spec.num_layers + 2:
        raise ValueError(
            f"--pp {args.pp} with {stages // args.pp} chunk(s) makes {stages} stages but the "
            f"model has {spec.num_layers + 2} blocks (--layers {spec.num_layers} + embedding "
            "+ head): use fewer stages or more layers"
        )


def _plan(args: argparse.Namespace, spec: GPTSpec, dtype: str) -> SimPlan:
    chunks = schedule_kind(args.schedule).chunks(args.chunks)
    return SimPlan(
        dp=args.dp,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        schedule=args.schedule,
        microbatches=args.microbatches,
        micro_batch_size=args.micro_batch_size,
        chunks=chunks,
        recompute=args.recompute,
        zero=args.zero,
        dtype=dtype,
        sequence_parallel=args.sequence_parallel,
        optimizer=args.optimizer,
        seq_len=spec.seq_len,
        compress=args.compress,
        offload_activations=args.offload_activations,
        offload_optimizer=args.offload_optimizer,
    )


_NOT_GENERATED = tuple(
    f.name for f in fields(ParallelPlan) if f.name not in ("dp_replicate", "dp_shard")
)
_FROM_PLAN = {
    "dp": "dp", "dp_replicate": "dp_replicate", "dp_shard": "dp_shard", "tp": "tp",
    "pp": "pp", "ep": "ep", "schedule": "schedule",
    "microbatches": "microbatches",
    "chunks": "chunks", "recompute": "recompute", "zero": "zero", "dtype": "dtype",
    "sequence_parallel": "sequence_parallel", "micro_batch_size": "micro_batch_size",
    "compress": "compress", "offload_activations": "offload_activations",
    "offload_optimizer": "offload_optimizer",
    "wsp_staleness": "wsp_staleness", "wsp_wave": "wsp_wave", "pipelines": "pipelines",
}  # fmt: skip
_MODEL_FROM_PLAN = {"name": "model", "layers": "layers", "hidden": "hidden", "heads": "heads",
                    "seq_len": "seq_len", "vocab": "vocab", "ffn_hidden": "ffn_hidden",
                    "experts": "experts", "top_k": "top_k",
                    "capacity_factor": "capacity_factor", "moe_every": "moe_every",
                    "shared_expert": "shared_expert", "imbalance": "imbalance"}  # fmt: skip


def _apply_plan(args: argparse.Namespace) -> None:
    """Take the layout (and model, and cluster when not given) from `--plan`."""
    from plait.plan.io import read_plan

    data = read_plan(args.plan)
    for key, attr in _FROM_PLAN.items():
        if key in data:
            setattr(args, attr, data[key])
    for key, attr in _MODEL_FROM_PLAN.items():
        if key in data.get("model", {}):
            setattr(args, attr, model_value(key, data["model"][key]))
    if args.cluster is None:
        args.cluster = data.get("cluster")


def run(args: argparse.Namespace) -> int:
    if args.plan:
        _apply_plan(args)
    args.dp, _, _, args.zero = resolve_dp(args.dp, args.dp_replicate, args.dp_shard, args.zero)
    if not args.cluster:
        raise ValueError("--cluster is required (a preset or a TOML file), or a --plan naming one")
    spec = spec_from_args(args)
    _check(args, spec)
    dtype = normalize_dtype(args.dtype)
    plan = _plan(args, spec, dtype)
    if args.wsp_staleness is not None:  # before simulating: what training would refuse
        check_wsp(plan, args.wsp_staleness, args.wsp_wave, args.pipelines)
    given = load_cluster(args.cluster)
    if given.name == "local-cpu" and plan.world_size > given.num_devices:
        # this machine cannot grow nodes the way a preset of a data centre can
        raise ValueError(
            f"dp × tp × pp = {plan.world_size} ranks but cluster 'local-cpu' (this machine) "
            f"has {given.num_devices} devices: shrink the plan"
        )
    cluster = scaled_cluster(given, plan.world_size)
    if args.profile:
        from plait.profile.codec import read_codec_profile, with_codec

        cluster = with_codec(cluster, read_codec_profile(args.profile))
    cluster.device(0).peak(dtype)  # a device without this dtype fails here, naming it
    blocks = spec.block_costs(micro_batch_size=args.micro_batch_size, dtype=dtype, layout=plan)
    prediction = predict(blocks, cluster, plan)
    summary = to_dict(prediction, spec)
    if args.wsp_staleness is not None:
        summary["wsp"] = wsp_summary(blocks, cluster, plan, prediction.partition.sizes,
                                     staleness=args.wsp_staleness, wave=args.wsp_wave,
                                     pipelines=args.pipelines)  # fmt: skip
    _write_outputs(args, prediction)
    if args.json:
        json.dump(summary, sys.stdout, sort_keys=True)
        print()
    else:
        _print(summary)
        if "wsp" in summary:
            print_wsp(summary["wsp"])
    if not prediction.result.fits:
        print("\n".join(overflow_lines(prediction.result)), file=sys.stderr)
    return 0


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
        "  try --recompute full or selective, --zero 1..3 with --dp > 1, more --pp or --tp, "
        "a smaller --micro-batch-size, or a schedule holding fewer micro-batches (1f1b)"
    )
    return lines


def _span(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _write_outputs(args: argparse.Namespace, prediction: Prediction) -> None:
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


def _print(summary: dict[str, Any]) -> None:
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
