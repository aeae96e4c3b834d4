"""`plait bench`: measurements that compare plait with its peers; one subcommand each."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_parser"]

# benchmark name -> module under plait.bench defining `add_arguments(parser)` and `run(args)`
_BENCHES = {
    "pipeline": "plait.bench.pipeline",
    "dp": "plait.bench.dp",
    "sim-accuracy": "plait.bench.sim_accuracy",
    "planner": "plait.bench.planner",
    "async": "plait.bench.asynchronous",
    "faults": "plait.bench.faults",
    "compress": "plait.bench.compress",
    "moe": "plait.bench.moe",
    "repartition": "plait.bench.repartition",
    "single": "plait.bench.single",
    "hetpipe": "plait.bench.hetpipe",
    "arrival": "plait.bench.arrival",
    "scale": "plait.bench.scale",
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="benchmarks against peers (slow; not part of the tests)")
    benches = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, module in _BENCHES.items():
        mod = importlib.import_module(module)
        bp = benches.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)
