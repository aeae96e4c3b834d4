"""Checks every configuration dataclass shares: each field holds its declared type (TOML,
JSON and the API alike), positive integers, settings that would have no effect."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from collections.abc import Callable
from operator import attrgetter
from typing import Any

__all__ = ["check_types", "coerce", "describe", "hints", "positive", "warn_unused"]


_HINTS: dict[type[Any], dict[str, Any]] = {}


def hints(cls: type[Any]) -> dict[str, Any]:
    # resolved once per class: the annotations are strings under `from __future__`
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join("unset" if a is type(None) else describe(a) for a in args)
    if typing.get_origin(hint) is tuple:
        item = args[0]
        if typing.get_origin(item) is typing.Literal:
            return f"a list, each of {list(typing.get_args(item))}"
        return "a list of integers"
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {list(args)}"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


_PLAIN = (int, str, bool)
# (origin, args) of each hint met: typing computes them anew on every call, and the planner
# builds tens of thousands of plans
_SHAPES: dict[Any, tuple[Any, tuple[Any, ...]]] = {}


def coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(ok, value converted to `hint`): ints widen to floats, lists become tuples; nothing
    else converts (a bool is not an integer here, a string is not a number)."""
    if type(value) is hint and hint in _PLAIN:  # the common case, without typing's walk
        return True, value
    shape = _SHAPES.get(hint)
    if shape is None:
        shape = _SHAPES[hint] = (typing.get_origin(hint), typing.get_args(hint))
    origin, args = shape
    if origin in (types.UnionType, typing.Union):
        for arg in args:
            ok, out = (value is None, None) if arg is type(None) else coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return False, value
        items = [coerce(v, args[0]) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if origin is typing.Literal:
        return value in args, value
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number, float(value) if number else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value  # a hint this checker does not know: the field validates itself


def _plain_check(hint: Any) -> Callable[[Any], bool] | None:
    """A test that passes only values `coerce` keeps as they are and `check_types` accepts
    (no float, no empty string), or None where each value takes the full walk."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal and all(type(a) in _PLAIN and a != "" for a in args):
        return lambda v: type(v) in _PLAIN and v in args
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        other = args[0] if args[1] is type(None) else args[1]
        if other is int or other is bool:
            return lambda v: v is None or type(v) is other
        return lambda v: v is None  # unset: any other value takes the walk
    return None


class _Plain:
    """One dataclass's fields, and a test that every value is of its plain type as
    declared (an exact int, bool or non-empty str, a Literal's value, None for an optional
    one), in a few C-level passes: the planner builds tens of thousands of plans, all of
    whose fields almost always pass, and only an object that fails takes the full walk."""

    def __init__(self, cls: type[Any]) -> None:
        declared = hints(cls)
        self.fields = tuple((f.name, declared[f.name]) for f in dataclasses.fields(cls))
        exact = [(n, h) for n, h in self.fields if h in _PLAIN]
        self.exact_types = tuple(h for _, h in exact)
        self.exact = attrgetter(*(n for n, _ in exact)) if len(exact) > 1 else None
        strings = [n for n, h in exact if h is str]
        self.strings = attrgetter(*strings) if len(strings) > 1 else None
        rest = [(n, h) for n, h in self.fields if h not in _PLAIN or self.exact is None]
        checks = [(n, _plain_check(h)) for n, h in rest]
        self.rest = tuple((n, c) for n, c in checks if c is not None)
        # a class of other shapes (not SimPlan's) always takes the walk
        self.plain = all(c is not None for _, c in checks) and self.strings is not None

    def passes(self, obj: Any) -> bool:
        if not self.plain or self.exact is None or self.strings is None:
            return False
        if tuple(map(type, self.exact(obj))) != self.exact_types or "" in self.strings(obj):
            return False
        return all(check(getattr(obj, name)) for name, check in self.rest)


_PLAINS: dict[type[Any], _Plain] = {}


def check_types(obj: Any) -> None:
    """Every field of the dataclass `obj` holds its declared type, or a ValueError names
    the field, the value and the type it should have (TOML, JSON and the API alike)."""
    cls = type(obj)
    plain = _PLAINS.get(cls)
    if plain is None:
        plain = _PLAINS[cls] = _Plain(cls)
    if plain.passes(obj):
        return
    for name, hint in plain.fields:
        _check_field(obj, name, hint, getattr(obj, name))


def _check_field(obj: Any, name: str, hint: Any, value: Any) -> None:
    ok, converted = coerce(value, hint)
    if not ok:
        raise ValueError(f"{name}={value!r} must be {describe(hint)}, not {type(value).__name__}")
    if isinstance(converted, float) and not math.isfinite(converted):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if converted == "":  # an empty flag or TOML string is a slip, never a choice
        raise ValueError(f"{name}='' is empty: give a value, or leave {name} unset")
    if converted is not value:
        object.__setattr__(obj, name, converted)


def positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def warn_unused(obj: Any, names: tuple[str, ...], why: str) -> None:
    """Warn about each of `names` set to other than its default: it has no effect (`why`)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in names and f.default is not dataclasses.MISSING and value != f.default:
            warnings.warn(f"{f.name}={value!r} has no effect {why}: drop it", stacklevel=3)
