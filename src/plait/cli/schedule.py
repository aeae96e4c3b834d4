"""`plait schedule`: print a generated schedule as a grid or as JSON."""

from __future__ import annotations

import argparse

from plait.cli.options import deprecated_flag
from plait.schedule import (
    KINDS,
    build,
    compute_only,
    format_grid,
    format_program,
    schedule_kind,
    unroll,
    validate,
)

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "schedule",
        help="print a pipeline schedule (grid or JSON)",
        description="Generate, validate and print a pipeline schedule. The grid has one row "
        "per rank and one column per time unit under unit costs (forward 1, backward 2). An "
        "asynchronous schedule is one window of a stream: the grid shows a run of --windows "
        "windows with its warm-up and drain, weight versions as v<n>.",
    )
    p.add_argument(
        "kind",
        choices=list(KINDS),
        help="; ".join(f"{k.name}: {k.summary}" for k in KINDS.values()),
        metavar="KIND",
    )
    p.add_argument("--pp", type=int, dest="stages", metavar="P", help="pipeline ranks P (required)")
    deprecated_flag(p, "--stages", "--pp", "stages", type=int)
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches M per window")
    p.add_argument("--chunks", type=int, default=None, help="virtual stages per rank (interleaved)")
    p.add_argument(
        "--windows",
        type=int,
        default=None,
        help="windows of the run to draw (default: 1 for a synchronous schedule, 3 otherwise)",
    )
    p.add_argument("--json", action="store_true", help="print the lowered window as JSON")
    p.add_argument(
        "--program",
        action="store_true",
        help="print program order with sends, receives, reductions and weight copies",
    )
    p.set_defaults(func=run)


# the grid has stages rows and about 2 × microbatches columns per window: beyond this it is
# neither printable nor quick to build and validate
_LARGEST = 512


def run(args: argparse.Namespace) -> int:
    if args.stages is None:
        raise ValueError("--pp is required: the pipeline ranks of the schedule (e.g. --pp 4)")
    for flag, value in (("--pp", args.stages), ("--microbatches", args.microbatches)):
        if value < 1:
            raise ValueError(f"{flag} {value}: use a positive count")
        if value > _LARGEST:
            raise ValueError(
                f"{flag} {value} is more than this command prints ({_LARGEST}): a grid of "
                "that size is unreadable; the schedule's shape shows at a few dozen"
            )
    if args.json and (args.windows is not None or args.program):  # JSON is one lowered window
        flag = f"--windows {args.windows}" if args.windows is not None else "--program"
        raise ValueError(f"{flag} has no effect with --json, which prints one window: drop one")
    kind = schedule_kind(args.kind)
    try:
        chunks = kind.chunks(args.chunks)
    except ValueError as err:
        raise ValueError(f"--chunks {args.chunks}: {err}") from None
    schedule = build(args.kind, args.stages, args.microbatches, chunks)
    if args.json:
        print(schedule.to_json())
        return 0
    windows = args.windows if args.windows is not None else (1 if kind.synchronous else 3)
    if windows < 1:
        raise ValueError(f"--windows {windows}: draw at least one window")
    report = validate(schedule)
    run_ = unroll(schedule, windows).schedule
    print(format_program(run_) if args.program else format_grid(compute_only(run_)))
    summary = (
        f"\n{schedule.kind}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches; unit-cost makespan {report.makespan:g}, "
        f"bubble {report.bubble_fraction:.1%}, peak in-flight micro-batches per rank "
        f"{list(report.peak_inflight)}"
    )
    if not kind.synchronous:
        summary += (
            f"\nasynchronous ({kind.policy}): {report.window_time:g} time units per window in "
            f"the steady state; weight versions alive per rank at most "
            f"{list(report.peak_weight_versions)}"
        )
    print(summary)
    return 0
