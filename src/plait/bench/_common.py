"""Helpers every bench shares: single-threaded workers, per-step timing, JSON and tables."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "Timing",
    "across_ranks",
    "busy",
    "max_grad_diff",
    "median",
    "now",
    "print_json",
    "print_table",
    "report",
    "single_thread",
    "timed",
    "token_batch",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Timing(Generic[T]):
    """What one call cost: wall-clock seconds, CPU seconds of this process (all its
    threads), and the call's return value."""

    wall_s: float
    cpu_s: float
    value: T


def single_thread() -> None:
    """Pin this process to one intra-op thread, so that workers sharing a CPU do not fight."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def timed(fn: Callable[[], T]) -> Timing[T]:
    """Call `fn()` and say how long it took.

    CPU time is less disturbed than wall time by other processes on a shared machine, but
    it also counts threads that spin while they wait (e.g. a communication library's).
    """
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return Timing(time.perf_counter() - wall, time.process_time() - cpu, value)


def across_ranks(
    per_rank: Sequence[Sequence[float]], combine: Callable[[Sequence[float]], float] = max
) -> list[float]:
    """Per step, the ranks' times combined: `max` gives the step's wall time (a pipeline
    step ends when its slowest rank does), `sum` the CPU time of all ranks together."""
    if len({len(times) for times in per_rank}) > 1:
        raise RuntimeError(f"ranks timed different step counts: {[len(t) for t in per_rank]}")
    return [float(combine(step)) for step in zip(*per_rank, strict=True)]


def max_grad_diff(a: Iterable[Any], b: Iterable[Any]) -> float:
    """Largest |gradient difference| between two sequences of like modules (inf where only one
    of a pair of parameters has a gradient): did two runtimes compute the same step?"""
    worst = 0.0
    for ma, mb in zip(a, b, strict=True):
        for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
            if (p.grad is None) != (q.grad is None):
                return float("inf")
            if p.grad is not None:
                worst = max(worst, float((p.grad - q.grad).abs().max()))
    return worst


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values: time at least one step")
    return float(statistics.median(values))


def print_json(obj: dict[str, Any]) -> None:
    """Print `obj` as exactly one line of JSON on stdout (what scripts parse)."""
    json.dump(obj, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], *, footer: str = ""
) -> None:
    """A rich table: the first column left-aligned, floats with 4 decimals, then `footer`."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row))
    console = Console()
    console.print(table)
    if footer:
        console.print(footer)


def report(result: Any, *, as_json: bool, table: Callable[[Any], None]) -> int:
    """Print a bench result (one JSON object, or `table`); exit 1 when the runtimes
    compared did not compute the same losses."""
    if as_json:
        print_json(result.to_dict())
    else:
        table(result)
    return 0 if result.loss_match else 1


def token_batch(config: Any, step: int, device: Any) -> tuple[Any, Any]:
    """Step `step`'s token ids and next-token targets ([batch_size, seq_len] each), the same
    on every rank: drawn from `config.seed` and the step, over `config.vocab_size` tokens."""
    import torch

    g = torch.Generator().manual_seed(config.seed + 1000 + step)
    ids = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=g)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def now(device: Any) -> float:
    """The wall clock once `device`'s queued work is done (a GPU runs asynchronously)."""
    from plait.device import synchronize

    synchronize(device)
    return time.perf_counter()


def busy(seconds: float, work: Any, device: Any) -> None:
    """Compute (`work @ work`, again and again) for `seconds` of wall time, each product
    finished before the clock is read, so that the time is spent and not queued."""
    end = time.perf_counter() + seconds
    while now(device) < end:
        work @ work
