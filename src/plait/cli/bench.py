"""`plait bench`: measurements that compare plait with its peers; one subcommand each.

A bench's module is imported only when it is chosen (`plait bench NAME ...`): most build
their defaults from torch models, and `plait bench --help` lists them from their
docstrings, read from the source without running it."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
from pathlib import Path

from plait.cli.lazy import lazy_subparsers

__all__ = ["add_parser", "summary"]

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
    "cp": "plait.bench.cp",
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="benchmarks against peers (slow; not part of the tests)")
    benches = lazy_subparsers(p, dest="bench", metavar="BENCH", required=True)
    for name, module in _BENCHES.items():
        benches.add_lazy(name, functools.partial(_fill, module), help=summary(_docstring(module)))


def _fill(module: str, parser: argparse.ArgumentParser) -> None:
    bench = importlib.import_module(module)
    bench.add_arguments(parser)
    parser.set_defaults(func=bench.run)


def _docstring(module: str) -> str:
    """`module`'s docstring, read from its source (the module is not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""


def summary(doc: str) -> str:
    """A module docstring's first sentence, which may run over several lines: the help
    `plait bench --help` lists (its first line alone can stop mid-sentence)."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]
