"""`plait schedule`: print a generated schedule as a grid or as JSON."""

from __future__ import annotations

import argparse

from plait.schedule import GENERATORS, build, compute_only, format_grid, format_program, validate

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "schedule",
        help="print a pipeline schedule (grid or JSON)",
        description="Generate, validate and print a pipeline schedule. The grid has one row "
        "per rank and one column per time unit under unit costs (forward 1, backward 2).",
    )
    p.add_argument("kind", choices=sorted(GENERATORS), help="schedule generator")
    p.add_argument("--stages", type=int, required=True, help="pipeline ranks P")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches M per step")
    p.add_argument("--chunks", type=int, default=None, help="virtual stages per rank (interleaved)")
    p.add_argument("--json", action="store_true", help="print the lowered schedule as JSON")
    p.add_argument("--program", action="store_true", help="print program order with sends/receives")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    chunks = args.chunks if args.chunks is not None else (2 if args.kind == "interleaved" else 1)
    for flag, value in (("--stages", args.stages), ("--microbatches", args.microbatches)):
        if value < 1:
            raise ValueError(f"{flag} {value}: use a positive count")
    if args.kind != "interleaved" and chunks != 1:
        raise ValueError(f"--chunks {chunks} applies only to 'interleaved': drop --chunks")
    if args.kind == "interleaved" and chunks < 2:
        raise ValueError(f"--chunks {chunks}: interleaved needs at least 2; or use 1f1b")
    schedule = build(args.kind, args.stages, args.microbatches, chunks)
    if args.json:
        print(schedule.to_json())
        return 0
    report = validate(schedule)
    if args.program:
        print(format_program(schedule))
    else:
        print(format_grid(compute_only(schedule)))
    print(
        f"\n{schedule.kind}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches; unit-cost makespan {report.makespan:g}, "
        f"bubble {report.bubble_fraction:.1%}, peak in-flight micro-batches per rank "
        f"{list(report.peak_inflight)}"
    )
    return 0
