"""The command-line flags generated from the config dataclasses' fields, one per field.

A field `eval_every: int = field(default=10, metadata={"help": ...})` becomes
`--eval-every N` with that help and its default shown; the flag's value lands in the
namespace under the field's dotted path (`parallel.pp`), None when not given, so a TOML
file and the dataclass default stay in charge of what the user did not type. Metadata
may name the flag (`"flag": "--timeout"`), skip it (`"flag": None`), give `"choices"`,
a `"metavar"` or a `"default_text"` for the help, describe its values (`"values"`: value ->
what it is, listed after the help), and the section of `--help` it is listed in
(`"group"`, one of `GROUPS`; a section dataclass's fields take its own field's group).
Other commands (`plan`, `simulate`, `profile`) generate their flags of the same fields
here too, so that a setting has one spelling and one description everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from plait.flags import deprecated_flag

__all__ = [
    "GROUPS",
    "add_config_flags",
    "add_groups",
    "config_flags",
    "deprecated_flag",
    "int_list",
    "number",
    "word_list",
]

#: The sections of `plait train --help`, in the order listed: name -> what its flags set.
GROUPS: dict[str, str] = {
    "model": "the model: a reference model and its shape, a Hugging Face folder, or MODULE:FACTORY",
    "data": "the data, its tokenizer, the batch and the seed",
    "layout": "the workers and how the model is spread over them (--plan auto chooses "
    "when no layout is given)",
    "pipeline": "the pipeline: schedule, micro-batches, stage partition, re-partitioning, WSP",
    "memory": "memory savers: ZeRO, recomputation, sequence parallelism, offloading",
    "numerics": "dtype, kernels and compilation",
    "communication": "between the workers: gradient compression, timeouts",
    "optimizer": "the optimizer, its learning-rate schedule and clipping",
    "evaluation": "validation during and after training, the sample after it",
    "checkpoints": "checkpoints, resuming and restarts",
    "logging": "the run folder, the console, metrics files, TensorBoard, W&B and traces",
}


def config_flags(cls: type[Any], prefix: str = "") -> dict[str, str]:
    """Dotted field path -> flag, for every field of `cls` (and its section dataclasses)
    that has one."""
    out: dict[str, str] = {}
    for path, f, _, _ in _leaves(cls, prefix):
        flag = _flag(f)
        if flag is not None:
            out[path] = flag
    return out


def add_groups(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The argument groups of `GROUPS` on `parser`, in their order."""
    return {name: parser.add_argument_group(name, text) for name, text in GROUPS.items()}


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type[Any],
    *,
    prefix: str = "",
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    groups: dict[str, argparse._ArgumentGroup] | None = None,
    section: str | None = None,
    defaults: dict[str, Any] | None = None,
    dests: dict[str, str] | None = None,
    choices: dict[str, Sequence[Any]] | None = None,
) -> None:
    """Add one flag per field of `cls` (sections recursively) to `parser`: those whose
    dotted paths `only` lists, when given, and never those of `skip` (which the command
    declares itself). With `groups` (`add_groups`), each flag goes to the group its field
    names, else to its section's (`section`). `defaults` gives a command's own default of a
    path (set, and shown in the help; a pair (value, text) shows the text); other flags
    default to None, leaving the dataclass in charge. A value lands under its path unless
    `dests` names another attribute (for a command whose code reads that name); `choices`
    narrows a path to the values a command can take (the help then describes only those,
    of a field whose metadata describes its `"values"`)."""
    for path, f, hint, group in _leaves(cls, prefix, section):
        flag = _flag(f)
        if flag is None or path in skip or (only is not None and path not in only):
            continue
        target = parser
        if groups is not None:
            if group not in groups:
                raise KeyError(f"{path}: metadata group={group!r} is not one of {list(groups)}")
            target = groups[group]
        own = (defaults or {}).get(path, _UNSET)
        value, text = own if isinstance(own, tuple) else (own, own)
        kind = _kind(f, hint, _UNSET if own is _UNSET else text, (choices or {}).get(path))
        dest = (dests or {}).get(path, path)
        target.add_argument(flag, dest=dest, default=None if own is _UNSET else value, **kind)


def _leaves(
    cls: type[Any], prefix: str = "", section: str | None = None
) -> Iterator[tuple[str, dataclasses.Field[Any], Any, str | None]]:
    """(dotted path, field, type hint, group) of every field of `cls` that is no section
    dataclass, sections' fields in place of theirs (they take their section's group)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, hint = prefix + f.name, hints[f.name]
        group = f.metadata.get("group", section)
        if dataclasses.is_dataclass(hint):
            yield from _leaves(typing.cast(type, hint), f"{path}.", group)
        else:
            yield path, f, hint, group


def _flag(f: dataclasses.Field[Any]) -> str | None:
    return typing.cast("str | None", f.metadata.get("flag", "--" + f.name.replace("_", "-")))


_UNSET = object()


def _default(f: dataclasses.Field[Any]) -> Any:
    if "default_text" in f.metadata:
        return f.metadata["default_text"]
    if f.default is not dataclasses.MISSING:
        return "unset" if f.default is None else f.default
    return None


def _kind(
    f: dataclasses.Field[Any], hint: Any, shown: Any = _UNSET, narrowed: Sequence[Any] | None = None
) -> dict[str, Any]:
    """argparse keywords for a field of type `hint` (its help shows `shown` as the default
    when given, else the field's; `narrowed`: the only values a command takes)."""
    help_text = _help(f, narrowed)
    default = _default(f) if shown is _UNSET else shown
    if default is not None:
        text = str(default).lower() if isinstance(default, bool) else str(default)
        help_text = f"{help_text} (default: {text})" if help_text else f"default: {text}"
    out: dict[str, Any] = {"help": help_text.replace("%", "%%")}
    base = _without_none(hint)
    if base is bool:
        out["action"] = argparse.BooleanOptionalAction
        return out
    if typing.get_origin(base) is typing.Literal:
        out["choices"] = list(typing.get_args(base))
    elif typing.get_origin(base) is tuple and typing.get_origin(typing.get_args(base)[0]) is (
        typing.Literal
    ):
        words = typing.get_args(typing.get_args(base)[0])
        out["type"] = functools.partial(word_list, words)
        out.setdefault("metavar", ",".join(words[:2]) + ",...")
    elif typing.get_origin(base) is tuple:
        out["type"] = int_list
        out.setdefault("metavar", "N,N,...")
    elif base in (int, float):
        out["type"] = int if base is int else _finite
    elif base is str:
        out["type"] = _text
    if "choices" in f.metadata:
        out["choices"] = list(f.metadata["choices"])
        if "type" not in out and out["choices"] and isinstance(out["choices"][0], int):
            out["type"] = int
    if narrowed is not None:  # the field's own metavar names values the command refuses
        out["choices"] = list(narrowed)
        out.pop("metavar", None)
    elif "metavar" in f.metadata:
        out["metavar"] = f.metadata["metavar"]
    elif "choices" not in out and "metavar" not in out:
        out["metavar"] = _METAVARS.get(base, "TEXT")
    return out


def _help(f: dataclasses.Field[Any], narrowed: Sequence[Any] | None) -> str:
    """The field's help, followed by what each of its `"values"` is (those of `narrowed`)."""
    text: str = f.metadata.get("help", "")
    values: dict[str, str] = f.metadata.get("values", {})
    listed = [v for v in values if narrowed is None or v in narrowed]
    if listed:
        text = f"{text}: " + "; ".join(f"{v} ({values[v]})" for v in listed)
    return text


_METAVARS: dict[Any, str] = {int: "N", float: "X"}


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _text(text: str) -> str:
    if not text.strip():  # an unset shell variable, most likely: never a setting
        raise argparse.ArgumentTypeError("an empty value; give one, or leave the flag out")
    return text


def word_list(words: Sequence[str], text: str) -> tuple[str, ...]:
    """`text`, a comma-separated list, as a tuple of its items, each one of `words`."""
    items = tuple(part.strip() for part in text.split(","))
    wrong = [item for item in items if item not in words]
    if wrong:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {wrong[0]!r} is not one of {', '.join(words)} (e.g. {words[-1]},{words[0]})"
        )
    return items


def int_list(text: str) -> tuple[int, ...]:
    """`text`, a comma-separated list of integers, as a tuple."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 2,3,1)"
        ) from None


def number(flag: str, text: str, kind: type[int] | type[float]) -> Any:
    """`text`, the value of `--flag`, as `kind`; a ValueError naming the flag if it is not one."""
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"--{flag} {text!r} is not {what}") from None
