"""Flag names that changed: an old name keeps working, with a one-line note naming the new one.

Commands (`plait.cli`) and benchmarks (`plait.bench`) both declare flags, and the
benchmarks may not import the command line, so the helper lives down here. plait speaks
one vocabulary across commands (`--batch-size` is the samples of a step over all replicas,
`--pp` the pipeline ranks); scripts written with a former name still run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["deprecated_flag"]


class _Deprecated(argparse.Action):
    """An old name of a flag: its value goes where the new name's does, with a one-line
    note on stderr naming the new one (scripts written for the old name keep working)."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is deprecated: use {self.new} (it means the "
              "same)", file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def deprecated_flag(
    parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs: Any
) -> None:
    """Accept `old`, a former name of the flag `new` (whose value lands in `dest`), hidden
    from `--help`: it sets the same value and says once that `new` is the name now."""
    parser.add_argument(old, dest=dest, action=_Deprecated, new=new, help=argparse.SUPPRESS,
                        **kwargs)  # fmt: skip
