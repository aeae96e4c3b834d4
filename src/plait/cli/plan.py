"""`plait plan`: choose data, tensor and pipeline degrees, schedule, micro-batching,
recomputation and sharding for a model on a cluster, and explain the choice."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser"]

_GIB = float(1 << 30)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from plait.cli.models import add_model_arguments, default_dtype
    from plait.cli.options import deprecated_flag

    p = sub.add_parser(
        "plan", help="search the best parallel layout and explain it", description=__doc__
    )
    add_model_arguments(p)
    a = p.add_argument
    a("--cluster", required=True, help="preset (local-cpu, dgx-a100-80gb, dgx-h100) or TOML file")
    a("--nodes", type=int, help="nodes of the preset (default: the preset's, or 1)")
    a("--devices", type=int, help="plan for this many devices (default: all of the cluster)")
    a(
        "--batch-size",
        type=int,
        dest="global_batch",
        metavar="N",
        help="samples per step over all replicas (the global batch; as `plait train --batch-size`)",
    )
    deprecated_flag(p, "--global-batch", "--batch-size", "global_batch", type=int)  # fmt: skip
    a("--top", type=int, default=5, help="plans to show (default 5)")
    a("--dtype", default=default_dtype(), help=f"training dtype (default {default_dtype()})")
    a(
        "--allow-staleness",
        action="store_true",
        dest="allow_staleness",
        help="also search asynchronous schedules (pipedream, 2bw, spectrain, ...), whose "
        "updates use stale weights: faster steps, possibly more steps to the same loss",
    )
    a("--compress", default="none", metavar="METHODS",
      help="gradient compressions to try for data-parallel plans, comma-separated (e.g. "
      "none,fp16,powersgd:4); lossy ones change what training converges to")  # fmt: skip
    a("--profile", help="a profile `plait profile --json` wrote: its measured encode/decode "
      "times of --compress replace the estimate from memory bandwidth")  # fmt: skip
    a("--wsp-staleness", type=int, metavar="N", dest="wsp_allowance",
      help="let data-parallel replicas train under Wave Synchronous Parallel with at most N "
      "waves of staleness: the planner chooses D <= N and explains the trade")  # fmt: skip
    a("--loader-rate", type=float, metavar="SAMPLES_PER_S", dest="loader_rate",
      help="the input pipeline's samples per second per loading process: each data-parallel "
      "replica loads its batch while the devices compute, and a plan's step is the longer "
      "of the two (default: not modelled)")  # fmt: skip
    a("--no-offload", action="store_false", dest="offload",
      help="never keep activations or optimizer state in host memory (by default the "
      "search offloads where a plan fits only so and is the faster for it, or where "
      "nothing fits without)")  # fmt: skip
    a("--json", action="store_true", help="print one JSON object")
    a("--out", help="write the best plan as JSON (for `plait train --plan`)")
    p.set_defaults(func=run)


def check_out(path: str, flag: str = "--out") -> None:
    """`--out FILE` can be written: its folder exists and it is not itself a folder."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{flag} {path} is a folder: name a file, e.g. {out / 'plan.json'}")
    if not out.parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {out.parent} does not exist; create it first")


def run(args: argparse.Namespace) -> int:
    from plait.cli.models import spec_from_args
    from plait.plan import SearchSpace, describe, gpt_spec, moe_spec, search
    from plait.plan.explain import explain
    from plait.plan.io import plan_to_dict, write_plan
    from plait.plan.loader import check_rate
    from plait.plan.runners import runners_up, runners_up_text
    from plait.presets import load_cluster
    from plait.profile import MoESpec

    if args.global_batch is None:
        raise ValueError(
            "--batch-size is required: the samples of one step over all replicas (e.g. "
            "--batch-size 32)"
        )
    if args.global_batch < 1 or args.top < 1:
        raise ValueError(f"--batch-size {args.global_batch} and --top {args.top} must both be >= 1")
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices {args.devices} must be at least 1 (or unset: all)")
    if args.wsp_allowance is not None and args.wsp_allowance < 0:
        raise ValueError(f"--wsp-staleness {args.wsp_allowance} must be >= 0 waves")
    rate = check_rate(args.loader_rate, "--loader-rate")
    if args.out:  # checked now, not after the whole search ran
        check_out(args.out)
    if args.micro_batch_size != 1:  # the search chooses micro-batch sizes itself
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size} has no effect on `plait plan`, which "
            "searches micro-batch sizes itself: drop it"
        )
    if args.nodes is not None and args.cluster == "local-cpu":  # as `plait simulate` says
        raise ValueError(
            f"--nodes {args.nodes} with cluster 'local-cpu' (this machine), which cannot grow "
            "nodes: drop --nodes, or describe the nodes in a cluster TOML file"
        )
    spec = spec_from_args(args)
    cluster = load_cluster(args.cluster, num_nodes=args.nodes)
    if args.profile:
        from plait.profile.codec import read_codec_profile, with_codec
        from plait.profile.dispatch import read_dispatch_profile, with_dispatch

        cluster = with_codec(cluster, read_codec_profile(args.profile))
        cluster = with_dispatch(cluster, read_dispatch_profile(args.profile))
    sizes = {
        "num_layers": spec.num_layers,
        "hidden": spec.hidden,
        "num_heads": spec.num_heads,
        "seq_len": spec.seq_len,
        "vocab_size": spec.vocab_size,
        "ffn_hidden": spec.ffn_hidden,
        "dtype": args.dtype,
    }
    moe = spec.shape() if isinstance(spec, MoESpec) else None
    model = gpt_spec(**sizes) if moe is None else moe_spec(**sizes, moe=moe)
    t0 = time.perf_counter()
    orders = ("tp-dp-pp",) if cluster.is_homogeneous else ("tp-dp-pp", "tp-pp-dp")
    space = SearchSpace(
        dtype=args.dtype,
        rank_orders=orders,
        allow_staleness=args.allow_staleness,
        compress=tuple(c for c in args.compress.split(",") if c),
        offload=args.offload,
    )
    found = search(
        model,
        cluster,
        global_batch=args.global_batch,
        num_devices=args.devices,
        space=space,
        top_k=args.top,
        loader_samples_per_s=rate,
        wsp_allowance=args.wsp_allowance,
    )
    seconds = time.perf_counter() - t0
    model_desc: dict[str, Any] = {
        "name": "moe-gpt" if isinstance(spec, MoESpec) else "gpt",
        "layers": spec.num_layers,
        "hidden": spec.hidden,
        "heads": spec.num_heads,
        "seq_len": spec.seq_len,
        "vocab": spec.vocab_size,
    }
    if isinstance(spec, MoESpec):  # what `plait simulate --plan` needs to cost it again
        if spec.ffn_hidden:  # 0 stands for training's default, 4 × hidden
            model_desc["ffn_hidden"] = spec.ffn_hidden
        model_desc.update(
            experts=spec.num_experts, top_k=spec.top_k,
            capacity_factor=spec.capacity_factor, moe_every=spec.moe_every,
            shared_expert=spec.shared_expert, imbalance=spec.imbalance,
        )  # fmt: skip
    plans = [plan_to_dict(r, model=model_desc, cluster=cluster.name) for r in found.top]
    why = explain(found)
    runners = runners_up(found, model, cluster)
    codec = _codec_line(found.best.plan.compress, cluster)
    if codec:
        why = f"{why} {codec}"
    if args.wsp_allowance is not None:
        why = f"{why}\n{_wsp(found, model, cluster, args.wsp_allowance)}"
    if args.out:
        write_plan(args.out, plans[0])
    if args.json:
        print(
            json.dumps(
                {
                    "plans": plans,
                    "best": plans[0],
                    "explanation": why,
                    "runners_up": [r.to_dict() for r in runners],
                    "plan_seconds": seconds,
                    "num_candidates": found.num_candidates,
                    "num_simulated": found.num_simulated,
                    "num_rejected": len(found.rejected),
                    "cluster": cluster.name,
                    "num_devices": args.devices or cluster.num_devices,
                }
            )
        )
        return 0
    _table(found, describe)
    print(f"\n{why}")
    if runners:
        print(f"\n{runners_up_text(runners)}")
    print(
        f"\nsearched {found.num_candidates} layouts, simulated {found.num_simulated}, "
        f"in {seconds:.2f} s" + (f"; best plan written to {args.out}" if args.out else "")
    )
    return 0


def _wsp(found: Any, model: Any, cluster: Any, allowance: int) -> str:
    """Why the best plan trains under WSP with its D, or why no plan under WSP won."""
    from plait.plan.describe import describe
    from plait.plan.wsp import staleness_for

    best = found.best
    if best.plan.wsp_staleness is not None:
        plain = dataclasses.replace(best, wsp_step_s=0.0)
        sync = next((r for r in found.ranked if r.plan == dataclasses.replace(
            best.plan, wsp_staleness=None)), None)  # fmt: skip
        gain = (f"\nIts synchronous plan takes {sync.step_time_s:.4g} s a step "
                f"({sync.step_time_s / best.step_time_s:.2f}x WSP's)." if sync else "")  # fmt: skip
        return f"WSP: {staleness_for(plain, model, cluster, allowance).explanation}{gain}"
    wsp = next((r for r in found.ranked if r.plan.wsp_staleness is not None), None)
    if wsp is None:
        return (
            "WSP: no plan found can train under it (it joins two or more whole, unsharded "
            "pipelines: tp = 1, ZeRO 0, no experts, each rank with room for WSP's weight "
            "copies)"
        )
    return (
        f"WSP: not chosen: the fastest plan under it ({describe(wsp.plan)}, D="
        f"{wsp.plan.wsp_staleness}, {wsp.step_time_s:.4g} s a step) is slower than the best"
    )


def _codec_line(compress: str, cluster: Any) -> str:
    """Where the best plan's encode/decode time comes from; empty when it compresses nothing."""
    from plait.cost.compress import codec_source

    if compress == "none":
        return ""
    return f"Its {compress} encode/decode time: {codec_source(compress, cluster.device(0))}."


def _table(found: Any, describe: Any) -> None:
    from rich.table import Table

    from plait.console import console, size
    from plait.plan.describe import recompute

    table = Table(title="plans, best first")
    cp = any(r.plan.cp > 1 for r in found.top)  # a cp column only where some plan splits
    for col in (
        "#",
        ("dp×cp×tp×pp" if cp else "dp×tp×pp")
        + ("×ep" if any(r.plan.ep > 1 for r in found.top) else ""),
        "schedule",
        "micro-batches",
        "recompute",
        "ZeRO",
        "step s",
        "tokens/s",
        "MFU",
        "bubble",
        "comm",
        "peak/device",
        "headroom",
    ):
        table.add_column(col, justify="right")
    for i, r in enumerate(found.top, 1):
        p = r.plan
        sched = p.schedule + (f"×{p.chunks}" if p.chunks > 1 else "")
        pp = "+".join(map(str, p.depths)) if len(set(p.depths)) > 1 else str(p.pp)
        table.add_row(
            str(i), f"{p.dp}×" + (f"{p.cp}×" if cp else "")
            + f"{p.tp}{'+sp' if p.sequence_parallel else ''}×{pp}"
            + (f"×{p.ep}" if any(r.plan.ep > 1 for r in found.top) else ""), sched,
            f"{_shares(p)}×{p.micro_batch_size}",
            recompute(p), str(p.zero),
            f"{r.step_time_s:.3g}" + (" (input)" if r.input_bound else ""),
            f"{r.tokens_per_s:,.0f}", f"{r.mfu:.1%}",
            f"{r.bubble_fraction:.1%}", f"{r.comm_share:.1%}",
            size(max(r.peak_memory_bytes)),
            size(r.headroom_bytes) if math.isfinite(r.headroom_bytes) else "-",
        )  # fmt: skip
    console().print(table)


def _shares(plan: Any) -> str:
    """Micro-batches per pipeline: each pipeline's where they differ in depth, else the
    distinct shares."""
    if len(set(plan.depths)) > 1:
        return "+".join(map(str, plan.shares))
    return "/".join(map(str, sorted(set(plan.shares), reverse=True)))
