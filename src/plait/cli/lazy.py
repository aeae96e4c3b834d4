"""Subcommands whose flags are added only when one is chosen on the command line.

Some subcommands take their flags' defaults from configs that import torch (a bench's
model, an experiment's optimizer); building every such parser would import torch for
`plait --help`. `LazyChoices` registers each with its help line alone and adds the rest
when argparse meets its name."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LazyChoices", "lazy_subparsers"]

Fill = Callable[[argparse.ArgumentParser], None]


class LazyChoices(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subparsers filled in by `fills[name]` when `name` is chosen, once."""

    fills: dict[str, Fill]

    def add_lazy(self, name: str, fill: Fill, **kwargs: Any) -> argparse.ArgumentParser:
        """A subcommand `name` (help and the like in `kwargs`) whose flags `fill` adds."""
        self.fills[name] = fill
        parser: argparse.ArgumentParser = self.add_parser(name, **kwargs)
        return parser

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        name = str(values[0]) if isinstance(values, list | tuple) and values else ""
        fill = self.fills.pop(name, None)
        if fill is not None:
            fill(self._name_parser_map[name])
        super().__call__(parser, namespace, values, option_string)


def lazy_subparsers(parser: argparse.ArgumentParser, **kwargs: Any) -> LazyChoices:
    """`parser.add_subparsers(**kwargs)`, as a `LazyChoices`."""
    action = parser.add_subparsers(action=LazyChoices, **kwargs)
    assert isinstance(action, LazyChoices)
    action.fills = {}
    return action
