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
and their share of the step (`all_to_all_share`). `--cp` splits each sequence over cp ranks
(ring attention, `plait.cost.context`); the JSON names `cp` and each rank's exposed ring
seconds (`cp_comm_s`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from plait.cli.models import (
    add_model_arguments,
    check_ep,
    default_dtype,
    model_value,
    spec_from_args,
)
from plait.cli.options import add_config_flags
from plait.cli.plan import check_out
from plait.cli.simulate_depths import differ_in_depth, run_depths
from plait.cli.simulate_wsp import check_wsp, print_wsp, wsp_summary
from plait.cluster import normalize_dtype
from plait.config import ParallelPlan
from plait.layout import resolve_dp
from plait.presets import load_cluster
from plait.schedule import schedule_kind
from plait.sim import SimPlan

if TYPE_CHECKING:
    from plait.profile.analytic import GPTSpec

__all__ = ["add_parser", "run"]


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
    # the layout flags are generated from the plan's fields, as `plait train`'s are, with
    # this command's defaults: the smallest layout (one rank, one micro-batch)
    add_config_flags(p, ParallelPlan, skip=_NOT_GENERATED, defaults=_DEFAULTS)
    a("--dtype", default=default_dtype(), help=f"training dtype (default {default_dtype()})")
    a("--optimizer", choices=("adamw", "sgd", "adam"), default="adamw",
      help="whose state the memory counts: adamw (as `plait train`; adam keeps the same "
      "state) or sgd (default: adamw)")  # fmt: skip
    a("--profile", help="a profile `plait profile --json` wrote: its measured encode/decode "
      "times of --compress replace the estimate from memory bandwidth")  # fmt: skip
    a("--json", action="store_true", help="print one JSON object")
    a("--trace", help="write the predicted timeline as a Chrome/Perfetto trace (JSON)")
    a("--plot", help="draw the predicted timeline as a PNG (needs matplotlib)")
    p.set_defaults(func=run, pipelines=None)


def _check_cp(args: argparse.Namespace, spec: GPTSpec) -> None:
    if args.cp < 1:
        raise ValueError(f"--cp {args.cp} must be >= 1")
    if args.cp == 1:
        return
    if spec.seq_len % (2 * args.cp):
        raise ValueError(
            f"--cp {args.cp} needs --seq-len {spec.seq_len} divisible by 2·cp = {2 * args.cp} "
            "(each rank holds two zigzag chunks): change --cp or --seq-len"
        )
    if not schedule_kind(args.schedule).synchronous:
        raise ValueError(f"--cp {args.cp} with --schedule {args.schedule}: use a synchronous one")
    from plait.profile.analytic import MoESpec

    if args.ep > 1 or isinstance(spec, MoESpec):
        raise ValueError(f"--cp {args.cp} with a mixture of experts is not supported: --cp 1")


def _check(args: argparse.Namespace, spec: GPTSpec) -> None:
    _check_cp(args, spec)
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
        cp=args.cp,
        pp=args.pp,
        ep=args.ep,
        schedule=args.schedule,
        microbatches=args.microbatches,
        micro_batch_size=args.micro_batch_size,
        chunks=chunks,
        recompute=args.recompute,
        recompute_stages=args.recompute_stages,
        partition=args.partition,
        zero=args.zero,
        dtype=dtype,
        sequence_parallel=args.sequence_parallel,
        optimizer="adam" if args.optimizer == "adamw" else args.optimizer,
        seq_len=spec.seq_len,
        rank_order=args.rank_order,
        compress=args.compress,
        offload_activations=args.offload_activations,
        offload_optimizer=args.offload_optimizer,
    )


# the simulator prices dtypes training does not run (tf32, fp8): `--dtype` is its own;
# WSP's bound and pipelines of their own are not simulated from flags
_NOT_GENERATED = ("dtype", "wsp_at_most", "pipelines")
# the plan's own defaults where it has one, but the smallest layout: one pipeline rank,
# one micro-batch, and the schedule's own chunk count
_DEFAULTS: dict[str, object] = {
    **{f.name: f.default for f in fields(ParallelPlan) if f.default is not None},
    "pp": 1, "microbatches": 1,
    "chunks": (None, "the schedule's: 2 for interleaved and zb-v, else 1"),
}  # fmt: skip
_FROM_PLAN = {
    "dp": "dp", "dp_replicate": "dp_replicate", "dp_shard": "dp_shard", "tp": "tp", "cp": "cp",
    "pp": "pp", "ep": "ep", "schedule": "schedule",
    "microbatches": "microbatches",
    "chunks": "chunks", "recompute": "recompute", "recompute_stages": "recompute_stages",
    "partition": "partition",
    "zero": "zero", "dtype": "dtype",
    "sequence_parallel": "sequence_parallel", "micro_batch_size": "micro_batch_size",
    "compress": "compress", "offload_activations": "offload_activations",
    "rank_order": "rank_order",
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
        # a value the file leaves unset (null) does not clear a flag given with --plan
        if key in data and (data[key] is not None or getattr(args, attr, None) is None):
            setattr(args, attr, data[key])
    for key, attr in _MODEL_FROM_PLAN.items():
        if key in data.get("model", {}):
            setattr(args, attr, model_value(key, data["model"][key]))
    if args.cluster is None:
        args.cluster = data.get("cluster")


def run(args: argparse.Namespace) -> int:
    if args.plan:
        _apply_plan(args)
    args.cp = 1 if args.cp is None else args.cp
    args.dp, _, _, args.zero = resolve_dp(args.dp, args.dp_replicate, args.dp_shard, args.zero)
    if not args.cluster:
        raise ValueError("--cluster is required (a preset or a TOML file), or a --plan naming one")
    from plait.cli.simulate_report import overflow_lines, print_summary, to_dict, write_outputs
    from plait.plan.predict import predict, scaled_cluster

    spec = spec_from_args(args)
    _check(args, spec)
    dtype = normalize_dtype(args.dtype)
    plan = _plan(args, spec, dtype)
    if differ_in_depth(args.pipelines, plan.chunks):
        return run_depths(args, spec, plan)  # no (dp, pp) grid: each pipeline at its depth
    if args.wsp_staleness is not None:  # before simulating: what training would refuse
        check_wsp(plan, args.wsp_staleness, args.wsp_wave, args.pipelines)
    given = load_cluster(args.cluster)
    if given.name == "local-cpu" and plan.world_size > given.num_devices:
        # this machine cannot grow nodes the way a preset of a data centre can
        raise ValueError(
            f"dp × cp × tp × pp = {plan.world_size} ranks but cluster 'local-cpu' (this machine) "
            f"has {given.num_devices} devices: shrink the plan"
        )
    cluster = scaled_cluster(given, plan.world_size)
    if args.profile:
        from plait.profile.codec import read_codec_profile, with_codec
        from plait.profile.dispatch import read_dispatch_profile, with_dispatch

        cluster = with_codec(cluster, read_codec_profile(args.profile))
        cluster = with_dispatch(cluster, read_dispatch_profile(args.profile))
    cluster.device(0).peak(dtype)  # a device without this dtype fails here, naming it
    blocks = spec.block_costs(micro_batch_size=args.micro_batch_size, dtype=dtype, layout=plan)
    prediction = predict(blocks, cluster, plan)
    summary = to_dict(prediction, spec)
    if args.wsp_staleness is not None:
        summary["wsp"] = wsp_summary(blocks, cluster, plan, prediction.partition.sizes,
                                     staleness=args.wsp_staleness, wave=args.wsp_wave,
                                     pipelines=args.pipelines)  # fmt: skip
    write_outputs(args, prediction)
    if args.json:
        json.dump(summary, sys.stdout, sort_keys=True)
        print()
    else:
        print_summary(summary)
        if "wsp" in summary:
            print_wsp(summary["wsp"])
    if not prediction.result.fits:
        print("\n".join(overflow_lines(prediction.result)), file=sys.stderr)
    return 0
