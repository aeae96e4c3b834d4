"""The rich console that commands print tables through, and byte sizes as a person reads them.

Piped output (`| cat`, a batch system's log) has no terminal width, and rich then assumes
80 columns, cutting cells to `embed…`; a console that is not a terminal here is as wide as
its content needs (up to `PIPED_WIDTH`). Sizes are printed in the unit that shows them
(`512 KiB`, `1.25 GiB`), so a small model's memory does not read `0.00 GiB`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PIPED_WIDTH", "console", "size"]

#: Columns of a console that is not a terminal: wide enough for every table plait prints.
PIPED_WIDTH = 240

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def console(**kwargs: Any) -> Any:
    """A `rich.console.Console`; when stdout is not a terminal, `PIPED_WIDTH` columns wide."""
    from rich.console import Console

    out = Console(**kwargs)
    if not out.is_terminal and "width" not in kwargs:
        out = Console(width=PIPED_WIDTH, **kwargs)
    return out


def size(num_bytes: float) -> str:
    """`num_bytes` in the largest binary unit that keeps it at 1 or more, 3 significant
    digits: `0 B`, `512 B`, `1.5 KiB`, `826 MiB`, `11.8 GiB`."""
    value, unit = float(num_bytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{value:.0f} B"
    return f"{value:.3g} {_UNITS[unit]}" if abs(value) < 1000 else f"{value:.0f} {_UNITS[unit]}"
