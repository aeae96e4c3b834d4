"""`plait profile`: per-block costs of a model, measured on this machine or derived analytically.

Measured (the default when the model fits this machine): each block of the model is timed
on one micro-batch by `plait.profile` on the device training uses (`--device`: a GPU when
there is one) in the training dtype (fp32 weights, the forward under bf16/fp16 autocast),
forward, input-gradient and weight-gradient passes apart, with `--threads` intra-op
threads (one by default, as pipeline workers use); the device itself is measured too
(matmul FLOP/s per dtype, memory, the link between two GPUs), and the
result is cached. Analytic (`--analytic`, or automatically when the model is too large to
build here): FLOPs and bytes from `plait.cost.transformer_block_costs`, for any size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.cli.models import add_model_arguments, default_dtype, flag_error, spec_from_args
from plait.cluster import local_cpu, normalize_dtype
from plait.compression import DEFAULT_CODECS
from plait.cost import BlockCost

if TYPE_CHECKING:
    from plait.profile import BlockProfile, GPTSpec

__all__ = ["add_parser", "build_limit_bytes", "check_cache_dir", "run"]

_MEASURABLE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_cache_dir(path: str | None) -> None:
    """A profile cache folder that exists must be a folder (checked before measuring)."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"--cache-dir {path} is a file, not a folder: choose another path")


def build_limit_bytes() -> float:
    """The largest footprint `plait profile` builds and measures here: a quarter of RAM."""
    return _memory_bytes() / 4


def _memory_bytes() -> int:
    """This machine's memory, as the local-cpu preset reads it."""
    return local_cpu(devices=1).device(0).memory_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "profile",
        help="per-block costs of a model (measured here, or analytic)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_model_arguments(p)
    p.add_argument("--dtype", default=default_dtype(), help=f"dtype ({default_dtype()})")
    p.add_argument("--analytic", action="store_true", help="derive costs from sizes; build nothing")
    p.add_argument("--tp", type=int, default=1, help="analytic: tensor-parallel ranks per block")
    p.add_argument(
        "--sequence-parallel", action="store_true", dest="sequence_parallel", help="analytic"
    )
    d, a = _MEASURED_DEFAULTS, p.add_argument
    a("--threads", type=int, default=d["threads"], help="measured: intra-op threads (1)")
    a("--warmup", type=int, default=d["warmup"], help="measured: untimed runs per block")
    a("--repeats", type=int, default=d["repeats"], help="measured: timed runs (median)")
    a(
        "--codec",
        default=",".join(DEFAULT_CODECS),
        metavar="METHODS",
        help="measured: gradient compressions whose encode/decode time to measure, "
        "comma-separated ('none': measure none); `plait simulate/plan --profile` use them",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="measured: where to time the blocks (auto: a GPU when there is one, as "
        "`plait train` trains there)",
    )
    p.add_argument("--no-cache", action="store_true", dest="no_cache", help="measure again")
    p.add_argument("--cache-dir", dest="cache_dir", help="profile cache folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


_MEASURED_DEFAULTS = {"threads": 1, "warmup": 2, "repeats": 5}


def _check_mode(args: argparse.Namespace, analytic: bool) -> None:
    """Flags of the other mode (measured or analytic) do nothing: refuse them by name."""
    if args.tp < 1:
        raise ValueError(f"--tp {args.tp} must be >= 1")
    if not analytic and (args.tp != 1 or args.sequence_parallel):
        flag = f"--tp {args.tp}" if args.tp != 1 else "--sequence-parallel"
        raise ValueError(f"{flag} applies to analytic costs only: add --analytic, or drop it")
    if args.analytic:
        given = [f"--{k} {getattr(args, k)}" for k, v in _MEASURED_DEFAULTS.items()
                 if getattr(args, k) != v]  # fmt: skip
        if args.no_cache:
            given.append("--no-cache")
        if args.cache_dir:
            given.append(f"--cache-dir {args.cache_dir}")
        if args.device != "auto":
            given.append(f"--device {args.device}")
        if args.codec != ",".join(DEFAULT_CODECS):
            given.append(f"--codec {args.codec}")
        if given:
            raise ValueError(f"{given[0]} has no effect with --analytic (nothing is measured)")


def _measure(spec: GPTSpec, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """Blocks timed on the training device in the training dtype, as a worker runs them:
    fp32 weights, the forward under autocast for bf16 and fp16."""
    import torch

    from plait.device import resolve
    from plait.models import GPT
    from plait.profile import measured_device, profile_model, threads
    from plait.profile.local import measure_local

    kind = resolve(args.device)
    where = torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")
    model = spec.build()
    assert isinstance(model, torch.nn.Module)
    g = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, spec.seq_len)
    ids = torch.randint(0, spec.vocab_size, shape, generator=g)
    targets = torch.randint(0, spec.vocab_size, shape, generator=g)
    with threads(args.threads):
        profile = profile_model(
            model,
            ids,
            target=targets,
            loss_fn=GPT.loss,
            names=spec.block_names(),
            warmup=args.warmup,
            repeats=args.repeats,
            cache=not args.no_cache,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            device=where,
            dtype=dtype,
        )
        # a CPU's bf16/fp16 matmuls take seconds to time: only the dtype asked for there
        dtypes = ("fp32", "bf16", "fp16") if kind != "cpu" else sorted({"fp32", dtype})
        local = measure_local(kind, dtypes=dtypes, num_threads=args.threads)
    if kind == "cpu":
        local = dataclasses.replace(local, memory_bytes=_memory_bytes())
    threads_note = f" ({args.threads} thread{'s' if args.threads > 1 else ''})"
    name = local.name if kind != "cpu" else f"cpu{threads_note}"
    device = measured_device(
        name=name, flops=local.flops[dtype], dtype=dtype, memory_bytes=local.memory_bytes
    )
    costs = profile.costs(device, dtype)
    codec, codec_cached = _codec(args)
    dispatch = _dispatch(model, ids, where, args.threads)
    return {
        "source": "measured",
        "cached": profile.cached and codec_cached,
        "device": {
            "name": device.name,
            "type": kind,
            "count": local.count,
            "flops": local.flops[dtype],
            "flops_per_dtype": local.flops,
            "memory_bytes": local.memory_bytes,
            "link": local.to_dict()["link"],
            "dtype": dtype,
            "codec_s_per_entry": codec,
            "dispatch_s": dispatch,
        },
        "blocks": [_measured_row(b, c) for b, c in zip(profile.blocks, costs, strict=True)],
    }


def _dispatch(model: Any, ids: Any, where: Any, num_threads: int) -> float:
    """Host seconds to issue one block's forward or backward (`plait.profile.dispatch`),
    on one token of one sample: the issue alone, next to as little device work as can be."""
    from plait.blocks import as_blocks
    from plait.profile import threads
    from plait.profile.dispatch import measure_dispatch

    with threads(num_threads):
        return measure_dispatch(as_blocks(model), ids[:1, :1], device=where)


def _codec_methods(text: str) -> list[str]:
    """The `--codec` methods (checked before anything is measured)."""
    from plait.compression import parse_compression

    methods = [str(parse_compression(m)) for m in text.split(",") if m.strip()]
    return [m for m in methods if m != "none"]


def _codec(args: argparse.Namespace) -> tuple[dict[str, float], bool]:
    """Seconds per gradient entry of each `--codec` method's encode + decode (cached)."""
    from plait.profile import default_cache_dir, threads
    from plait.profile.codec import cached_codec_costs

    methods = _codec_methods(args.codec)
    if not methods:
        return {}, True
    folder = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    with threads(args.threads):
        return cached_codec_costs(
            methods, repeats=args.repeats, cache_dir=None if args.no_cache else folder
        )


def _measured_row(block: BlockProfile, cost: BlockCost) -> dict[str, Any]:
    row = block.to_dict()
    row["saved_bytes_recompute"] = cost.saved_for("full")
    row.update(
        forward_flops=cost.forward_flops,
        backward_input_flops=cost.backward_input_flops,
        backward_weight_flops=cost.backward_weight_flops,
    )
    return row


def _analytic(spec: GPTSpec, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    from plait.config import ParallelPlan
    from plait.profile import MoESpec

    if args.sequence_parallel and isinstance(spec, MoESpec):
        raise ValueError(
            "--sequence-parallel with --model moe-gpt, whose MoE layers take whole "
            "sequences: drop --sequence-parallel"
        )
    try:
        # one rank's blocks; --sequence-parallel with --tp 1 shards nothing, as it always did
        sp = args.sequence_parallel and args.tp > 1
        layout = ParallelPlan(tp=args.tp, pp=1, sequence_parallel=sp)
        blocks = spec.block_costs(
            micro_batch_size=args.micro_batch_size, dtype=dtype, layout=layout
        )
    except ValueError as error:
        raise flag_error(error) from None
    rows = [
        {
            "name": b.name,
            "forward_flops": b.forward_flops,
            "backward_input_flops": b.backward_input_flops,
            "backward_weight_flops": b.backward_weight_flops,
            "activation_bytes": b.activation_bytes,
            "saved_bytes": b.saved_for("none"),
            "saved_bytes_selective": b.saved_for("selective"),
            "saved_bytes_recompute": b.saved_for("full"),
            "num_params": b.num_params,
        }
        for b in blocks
    ]
    return {"source": "analytic", "tp": args.tp, "blocks": rows}


def run(args: argparse.Namespace) -> int:
    from plait.profile import MoESpec

    check_cache_dir(args.cache_dir)
    spec = spec_from_args(args)
    dtype = normalize_dtype(args.dtype)
    for name in ("threads", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup} must be >= 0")
    _codec_methods(args.codec)
    if not args.analytic:  # a GPU asked for and missing: said before anything is built
        from plait.device import resolve

        resolve(args.device)
    analytic = args.analytic
    if not analytic and dtype not in _MEASURABLE:
        raise ValueError(
            f"--dtype {args.dtype} cannot be measured on this machine: use one of "
            f"{sorted(_MEASURABLE)}, or --analytic"
        )
    footprint = spec.train_bytes(dtype, args.micro_batch_size)
    if not analytic and footprint > build_limit_bytes():
        print(
            f"plait profile: the model needs about {footprint / 2**30:.1f} GiB to measure, more "
            f"than a quarter of this machine's memory; using analytic costs instead",
            file=sys.stderr,
        )
        analytic = True
    _check_mode(args, analytic)
    if isinstance(spec, MoESpec) and not analytic:
        raise ValueError(
            "--model moe-gpt cannot be measured block by block yet (its blocks carry the "
            "router losses along): add --analytic"
        )
    out = _analytic(spec, args, dtype) if analytic else _measure(spec, args, dtype)
    out.update(
        model={**_spec_dict(spec), "num_params": spec.num_params()},
        dtype=dtype,
        micro_batch_size=args.micro_batch_size,
    )
    if args.json:
        json.dump(out, sys.stdout, sort_keys=True)
        print()
    else:
        _print(out)
    return 0


def _spec_dict(spec: GPTSpec) -> dict[str, Any]:
    return {k: getattr(spec, k) for k in spec.__dataclass_fields__}


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.3f}"
    if unit == "B":
        return f"{value / 2**20:.3f}"
    if unit == "n":  # a count: whole, with thousands separators
        return f"{value:,.0f}"
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def _print(out: dict[str, Any]) -> None:
    from rich.table import Table

    from plait.console import console as make_console

    measured = out["source"] == "measured"
    if measured:
        columns = [("forward_s", "fwd ms", "s"), ("backward_s", "bwd ms", "s")]
        columns += [("backward_input_s", "bwd-in ms", "s"), ("backward_weight_s", "bwd-w ms", "s")]
    else:
        columns = [("forward_flops", "fwd FLOPs", ""), ("backward_input_flops", "bwd-in", "")]
        columns.append(("backward_weight_flops", "bwd-w", ""))
    columns += [("activation_bytes", "sends MiB", "B"), ("saved_bytes", "keeps MiB", "B")]
    columns += [
        ("saved_bytes_recompute", "keeps (recompute) MiB", "B"),
        ("num_params", "params", "n"),
    ]
    m = out["model"]
    title = (
        f"{out['source']} costs of {'moe-gpt' if 'num_experts' in m else 'gpt'} "
        f"({m['num_layers']} layers, hidden {m['hidden']}, "
        f"{m['num_params']:,} parameters), micro-batch {out['micro_batch_size']}, {out['dtype']}"
    )
    table = Table(title=title)
    table.add_column("block")
    for _, header, _ in columns:
        table.add_column(header, justify="right")
    for row in out["blocks"]:
        table.add_row(row["name"], *(_fmt(float(row[k]), unit) for k, _, unit in columns))
    console = make_console()
    console.print(table)
    if measured:
        device = out["device"]
        console.print(
            f"measured on {device['name']} ({device['flops'] / 1e9:.1f} GFLOP/s matmul in "
            f"{out['dtype']})" + (", read from the cache" if out["cached"] else "")
        )
        rates = ", ".join(f"{k} {_rate(v)}" for k, v in device["flops_per_dtype"].items())
        link = device.get("link")
        between = (
            f"; between two of them {link['bandwidth_Bps'] / 1e9:.1f} GB/s, "
            f"{link['latency_s'] * 1e6:.1f} µs latency"
            if link
            else ""
        )
        console.print(
            f"{device['count']} × {device['name']}: matmul {rates}; memory "
            f"{device['memory_bytes'] / 2**30:.1f} GiB{between}"
        )
        if device.get("dispatch_s") is not None:
            console.print(
                f"host time to issue one block's forward or backward: "
                f"{device['dispatch_s'] * 1e6:.1f} µs (`plait plan/simulate --profile FILE`)"
            )
        codec = device.get("codec_s_per_entry", {})
        if codec:
            console.print(
                "gradient compression encode + decode, ns per entry: "
                + ", ".join(f"{k} {v * 1e9:.3g}" for k, v in codec.items())
                + " (`plait simulate/plan --profile FILE` use them: save this with --json)"
            )
