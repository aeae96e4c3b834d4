"""The layer table of plait: each room (a package or a root module) on one floor.

An import runs down the floors or along one; never up. `tests/unit/test_layers.py` checks
every import of `src/plait` against this table (top-level, in-function and `TYPE_CHECKING`
ones alike) and that docs/architecture.md shows the same table.
"""

from __future__ import annotations

__all__ = ["FLOORS", "OUTSIDE", "floor_of", "markdown_table"]

# floor -> rooms on it, top floor first; "__init__" is the package's own `plait/__init__.py`
FLOORS: dict[int, tuple[str, ...]] = {
    9: ("cli", "__main__"),
    8: ("bench", "experiment", "__init__"),
    7: ("train",),
    6: ("plan",),
    5: ("sim", "profile", "checkpoint"),
    4: ("parallel", "config", "emulate"),
    3: ("runtime",),
    2: ("device", "mesh", "heartbeat", "models", "cost", "data", "pipelines"),
    1: (
        "schedule",
        "cluster",
        "presets",
        "layout",
        "compression",
        "offload",
        "blocks",
        "trace",
        "wait",
        "compat",
        "keyed",
        "console",
        "flags",
        "dataspec",
        "pretrained",
        "_layers",
    ),
}

# rooms that only the CLI and each other may import: what training imports stays out of them
OUTSIDE: tuple[str, ...] = ("bench", "experiment")


def floor_of(room: str) -> int:
    """The floor of `room`; a KeyError names a room the table does not place."""
    for floor, rooms in FLOORS.items():
        if room in rooms:
            return floor
    raise KeyError(f"room {room!r} is on no floor of plait._layers.FLOORS: add it there")


def markdown_table() -> str:
    """The table as docs/architecture.md shows it."""
    lines = ["| floor | rooms |", "| --- | --- |"]
    for floor, rooms in FLOORS.items():
        lines.append(f"| {floor} | {', '.join(f'`{r}`' for r in rooms)} |")
    return "\n".join(lines)
