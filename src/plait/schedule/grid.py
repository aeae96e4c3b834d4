"""Text pictures of a schedule: the rank-by-time grid, and the rank-by-program-step grid."""

from __future__ import annotations

from plait.schedule.ir import COMM_OPS, Schedule
from plait.schedule.replay import Replay, replay

__all__ = ["format_grid", "format_program"]


def format_grid(
    schedule: Schedule,
    *,
    result: Replay | None = None,
    mark: frozenset[tuple[int, int]] = frozenset(),
) -> str:
    """Rows are ranks, columns are time under unit costs (forward 1, backward 2).

    A full backward `B` fills two columns (`0B1` then `~`). Idle time is `.`. Actions in
    `mark` (rank, program index) are bracketed; a rank that is stuck shows what it waits
    at after the last column it ran.
    """
    result = result or replay(schedule)
    columns = max(1, round(result.makespan))
    cells = [["."] * columns for _ in range(schedule.num_ranks)]
    for rank, program in enumerate(result.events):
        for event in program:
            if event.action.op in COMM_OPS:
                continue
            first, last = round(event.start), round(event.end)
            label = str(event.action)
            if (rank, event.index) in mark:
                label = f"[{label}]"
            for col in range(first, last):
                cells[rank][col] = label if col == first else "~"
    for stuck in result.blocked:
        cells[stuck.rank].append(f"[{stuck.action}] waits for {stuck.waiting_for}")
    width = max((len(c) for row in cells for c in row[:columns]), default=3)
    header = "time   " + " ".join(str(t).rjust(width) for t in range(columns))
    lines = [header]
    for rank, row in enumerate(cells):
        body = " ".join(c.rjust(width) for c in row[:columns])
        tail = " ".join(row[columns:])
        lines.append(f"rank {rank:<2}" + body + (f"  {tail}" if tail else ""))
    return "\n".join(lines)


def format_program(
    schedule: Schedule, *, mark: frozenset[tuple[int, int]] = frozenset(), comms: bool = True
) -> str:
    """Rows are ranks, columns are program steps; actions in `mark` are bracketed."""
    rows = []
    for rank, program in enumerate(schedule.ranks):
        labels = []
        for index, action in enumerate(program):
            if not comms and action.op in COMM_OPS and (rank, index) not in mark:
                continue
            label = str(action)
            labels.append(f"[{label}]" if (rank, index) in mark else label)
        rows.append(labels)
    width = max((len(c) for row in rows for c in row), default=3)
    return "\n".join(
        f"rank {rank:<2}" + " ".join(c.rjust(width) for c in row) for rank, row in enumerate(rows)
    )
