"""A generated sweep of bad input over every `plait` command, each case run in-process.

The contract every case meets: exit code 2; stderr holds one error line, `plait CMD:
error: ...` (argparse's own form, a `usage:` block followed by that one line, counts as
one error: the usage is argparse's, the line is the error), and that line names the
offending flag, field or value; no traceback; nothing written into the working
directory; and no work started (launching workers, measuring, benchmarking or running an
experiment raises `_WorkStarted` here, which no command catches).

`plait train`'s cases are generated from the config dataclasses' fields (`config_flags`):
every flag gets values of the wrong kind, out-of-range values from what the field means
(`_INT_MIN`, `_FLOAT_RANGE`), unknown words for closed vocabularies, empty text; the same
mistakes are written into a TOML `--config` file and into a `--plan` file. The other
commands get their own flags' mistakes, unknown and malformed clusters, missing files and
combinations that make no sense. `ACCEPTED` lists values that are legitimate although they
look like mistakes (0 where 0 means off); `NO_EFFECT` lists settings accepted but without
effect, each of which must warn or fail naming the setting.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import types
import typing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from plait.cli.main import main
from plait.cli.options import config_flags
from plait.config import ModelConfig, ParallelPlan, TrainConfig


@dataclass(frozen=True)
class Case:
    """One invalid command line: `names` are the words of which the error must say one
    (the flag, the field or the value); `files` are written into the working directory
    first (path -> text)."""

    argv: tuple[str, ...]
    names: tuple[str, ...]
    files: tuple[tuple[str, str], ...] = ()
    label: str = ""  # what is wrong in the files, for the test's name

    @property
    def id(self) -> str:
        what = self.label or (f"{self.files[0][1][:40]!r}" if self.files else "")
        return " ".join(self.argv) + (f" [{what}]" if what else "")


def _case(
    *argv: str, names: str | tuple[str, ...], files: dict[str, str] | None = None, label: str = ""
) -> Case:
    names = (names,) if isinstance(names, str) else names
    return Case(tuple(argv), names, tuple((files or {}).items()), label)


def _flag_case(*argv: str, flag: str, value: str, field: str | None = None) -> Case:
    """`argv` ending in `flag value`: the error names the flag, or the value as the setting
    behind the flag (`name=value`, `name value`; `field` when the flag's name differs), or
    a word typed as the value."""
    name = field or flag.lstrip("-").replace("-", "_")
    names = [flag, f"{name}={value}", f"{name} {value}", f"{name}={value!r}", f"{name}="]
    if any(c.isalpha() for c in value):
        names += [repr(value), f" {value} "]
    return _case(*argv, names=tuple(names))


# ---------------------------------------------------------------------------------------
# what each `plait train` setting means, written from its help (not from plait's output):
# the smallest integer it takes (None: any integer) ...
_INT_MIN: dict[str, int | None] = {
    "nproc": 1, "max_steps": 1, "batch_size": 1, "warmup_steps": 0, "eval_every": 1,
    "eval_batches": 0, "seed": None, "log_every": 1, "sample_chars": 0, "checkpoint_every": 1,
    "flush_every": 1, "keep": 0, "max_restarts": 0, "verbosity": -1, "trace_steps": 1,
    "model.layers": 1,
    "model.hidden": 1, "model.heads": 1, "model.seq_len": 1, "model.ffn_hidden": 1,
    "model.width": 1, "parallel.dp": 1, "parallel.tp": 1,
    "parallel.dp_replicate": 1, "parallel.dp_shard": 1, "parallel.pp": 1, "parallel.cp": 1,
    "parallel.microbatches": 1, "parallel.chunks": 1, "model.experts": 1, "model.top_k": 1,
    "model.moe_every": 1, "parallel.ep": 1, "repartition_patience": 1,
    "parallel.wsp_staleness": 0, "parallel.wsp_wave": 1,
}  # fmt: skip
# ... the range of each number: (lowest, whether the lowest itself is allowed, highest or None)
_FLOAT_RANGE: dict[str, tuple[float, bool, float | None]] = {
    "lr": (0.0, False, None), "weight_decay": (0.0, True, None), "beta1": (0.0, True, 1.0),
    "beta2": (0.0, True, 1.0), "eps": (0.0, False, None), "momentum": (0.0, True, None),
    "min_lr": (0.0, True, None), "grad_clip": (0.0, True, None), "timeout_s": (0.0, False, None),
    "model.dropout": (0.0, True, 1.0), "model.capacity_factor": (0.0, True, None),
    "model.aux_loss_coef": (0.0, True, None), "model.z_loss_coef": (0.0, True, None),
    "repartition_threshold": (0.0, False, None),
}  # fmt: skip
# ... and the free-text settings with a closed vocabulary (an unknown word is an error; any
# free text, a path included, must not be empty)
_VOCABULARY = (
    "optimizer",
    "lr_schedule",
    "data",
    "profile_steps",
    "parallel.compress",
    "plan",
    "parallel.offload_activations",
)


def _fields() -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """Dotted path -> (field, type hint without None) of every `plait train` setting."""
    out = {}
    for cls, prefix in ((TrainConfig, ""), (ModelConfig, "model."), (ParallelPlan, "parallel.")):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                continue
            if typing.get_origin(hint) in (types.UnionType, typing.Union):
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            out[prefix + f.name] = (f, hint)
    return out


FIELDS = _fields()
FLAGS = config_flags(TrainConfig)


def _kind(path: str) -> str:
    f, hint = FIELDS[path]
    if "choices" in f.metadata or typing.get_origin(hint) is typing.Literal:
        return "choice"
    if typing.get_origin(hint) is tuple:
        return "list"
    return {int: "int", float: "float", bool: "bool", str: "str"}[hint]


def _name(path: str) -> str:
    return path.rpartition(".")[2]


def _flag_values(path: str) -> Iterator[str]:
    """Values that `path`'s flag must refuse."""
    kind = _kind(path)
    if kind in ("int", "float", "choice", "list"):
        yield from ("abc", "")  # text where a number or a choice belongs; nothing
    if kind == "int":
        yield "1.5"
        low = _INT_MIN[path]
        if low is not None:
            yield str(low - 1)
    if kind == "float":
        yield from ("nan", "inf")
        low, closed, high = _FLOAT_RANGE[path]
        yield str(low - 0.5 if closed else low)
        if high is not None:
            yield str(high)  # every top here is open: a probability or a decay below 1
    if kind == "choice":
        yield "bogus" if isinstance(FIELDS[path][0].default, str) else "7"
    if kind == "list":
        yield from ("2,,2", "0,6")  # a hole; a stage without blocks
    if kind == "str":
        yield ""
        if path in _VOCABULARY:
            yield "bogus"


def _train_flag_cases() -> list[Case]:
    cases = []
    for path, flag in FLAGS.items():
        if _kind(path) == "bool":
            cases.append(_case("train", "--dry-run", f"{flag}=maybe", names=flag))
            continue
        for value in _flag_values(path):
            cases.append(_flag_case("train", "--dry-run", flag, value, flag=flag, value=value,
                                    field=_name(path)))  # fmt: skip
    return cases


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _toml_values(path: str) -> Iterator[str]:
    """TOML literals that `path` must refuse in a config file."""
    kind = _kind(path)
    low = _INT_MIN.get(path)
    if kind == "int":
        yield from ('"3"', "2.5", "true")
        if low is not None:
            yield str(low - 1)
    elif kind == "float":
        yield from ('"fast"', "true", "nan", "inf")
        lowest, closed, high = _FLOAT_RANGE[path]
        yield str(lowest - 0.5 if closed else lowest)
        if high is not None:
            yield str(high)
    elif kind == "bool":
        yield from ('"yes"', "1")
    elif kind == "list":
        yield from ('"2,2"', '[1, "a"]', "[0, 6]")
    else:
        yield from ("3", '""')
        if kind == "choice" or path in _VOCABULARY:
            yield '"bogus"' if isinstance(FIELDS[path][0].default, str) else "7"


def _config_text(path: str, literal: str) -> str:
    section, _, name = path.rpartition(".")
    return f"[{section}]\n{name} = {literal}\n" if section else f"{name} = {literal}\n"


def _train_toml_cases() -> list[Case]:
    cases = []
    for path in FIELDS:
        for literal in _toml_values(path):
            text = _config_text(path, literal)
            # the setting with its value, or the file a path names ("plan file 3 ...")
            names = (f"{_name(path)}=", f"{_name(path)} file {literal}")
            cases.append(_case("train", "--dry-run", "--config", "c.toml", names=names,
                               files={"c.toml": text}, label=f"{path} = {literal}"))  # fmt: skip
    # not TOML; unknown keys and sections; a section that is no table; JSON, not an object
    bad = [("c.toml", "lr = = 3\n", "c.toml"), ("c.toml", "lrate = 0.1\n", "lrate"),
           ("c.toml", "[model]\nlayer = 2\n", "layer"),
           ("c.toml", "[modle]\nlayers = 2\n", "modle"), ("c.toml", "model = 3\n", "[model]"),
           ("c.json", "[1, 2]", "c.json")]  # fmt: skip
    for name, text, names in bad:
        cases.append(_case("train", "--dry-run", "--config", name, names=names, files={name: text}))
    return cases


# a plan file as `plait plan --out` writes it, for the model `plait train` builds by default
GOOD_PLAN: dict[str, Any] = {
    "dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b", "microbatches": 4, "chunks": 1, "zero": 0,
    "recompute": "none", "sequence_parallel": False, "dtype": "fp32", "partition": [3, 3],
    "micro_batch_size": 8, "global_batch": 32, "rank_order": "tp-dp-pp", "compress": "none",
    "model": {"name": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 96},
    "cluster": "local-cpu",
}  # fmt: skip
_PLAN_BAD: dict[str, tuple[Any, ...]] = {
    "dp": ("two", 0, -1, 1.5), "tp": ("x", 0, 3), "pp": ("two", 0, 9), "schedule": ("bogus", 3),
    "microbatches": ("x", 0, -2), "chunks": (0, 2, "x"), "zero": (5, "x", 1),
    "recompute": ("bogus", 1), "sequence_parallel": ("yes", True), "dtype": ("fp64", 16),
    "partition": ([3, 2], [0, 6], "3,3"), "compress": ("bogus", "powersgd:0", "fp16"),
    "global_batch": ("x", 0, -32, 30), "micro_batch_size": ("x", 0),
    "rank_order": ("bogus", 1), "model": ([1, 2], "gpt"),
}  # fmt: skip
_PLAN_MODEL_BAD: dict[str, tuple[Any, ...]] = {
    "layers": ("x", 0),
    "hidden": (0, 130),
    "heads": (0, "x"),
    "seq_len": (-1,),
}


def _plan_cases(command: tuple[str, ...]) -> list[Case]:
    cases = []
    for key, values in _PLAN_BAD.items():
        for value in values:
            plan = {**GOOD_PLAN, key: value}
            text = json.dumps(plan)
            # the key (or the flag it stands for), or a word typed as its value
            names = (key, key.replace("_", "-"), *([repr(value)] if isinstance(value, str) else []))
            cases.append(_case(*command, "--plan", "p.json", names=names,
                               files={"p.json": text}, label=f"{key}={value!r}"))  # fmt: skip
    for key, values in _PLAN_MODEL_BAD.items():
        for value in values:
            plan = {**GOOD_PLAN, "model": {**GOOD_PLAN["model"], key: value}}
            cases.append(_case(*command, "--plan", "p.json", names=(key, str(value)),
                               files={"p.json": json.dumps(plan)},
                               label=f"model.{key}={value!r}"))  # fmt: skip
    for text in ("{", "[1]", '{"dp": 1}'):  # not JSON, not an object, no layout
        cases.append(_case(*command, "--plan", "p.json", names="p.json", files={"p.json": text}))
    cases.append(_case(*command, "--plan", "missing.json", names="missing.json"))
    cases.append(_case(*command, "--plan", "folder", names="folder"))
    return cases


# ---------------------------------------------------------------------------------------
# a cluster file as plait.presets describes it: one node of two devices, every key given
_CLUSTER: dict[str, Any] = {
    "name": "lab",
    "inter_node": {"latency_s": 1e-5, "bandwidth_Bps": 1e10},
    "nodes": [{
        "count": 1, "devices_per_node": 2,
        "intra_node": {"latency_s": 1e-6, "bandwidth_Bps": 1e11},
        "device": {"name": "acc", "peak_flops": {"fp32": 1e13}, "efficiency": 0.5,
                   "memory_gib": 16, "memory_bandwidth_Bps": 1e12},
    }],
}  # fmt: skip


def _cluster_toml(data: dict[str, Any]) -> str:
    def inline(value: Any) -> str:
        if isinstance(value, dict):
            return "{ " + ", ".join(f"{k} = {inline(v)}" for k, v in value.items()) + " }"
        return _toml(value)

    lines = [f"{k} = {inline(v)}" for k, v in data.items() if k != "nodes"]
    for node in data.get("nodes", []):
        lines += ["[[nodes]]", *(f"{k} = {inline(v)}" for k, v in node.items())]
    return "\n".join(lines) + "\n"


def _mutated(where: tuple[str, ...], value: Any) -> dict[str, Any]:
    """`_CLUSTER` with the key at `where` (a path through tables; "0" indexes nodes) set to
    `value`, or removed when `value` is `_DROP`."""
    data = json.loads(json.dumps(_CLUSTER))
    table = data
    for key in where[:-1]:
        table = table[int(key)] if key.isdigit() else table[key]
    if value is _DROP:
        del table[where[-1]]
    else:
        table[where[-1]] = value
    return data


_DROP = object()
_CLUSTER_BAD: list[tuple[tuple[str, ...], Any, str]] = [
    (("nodes",), _DROP, "nodes"),
    (("nodes",), [], "nodes"),
    (("inter_node", "latency_s"), _DROP, "latency_s"),
    (("inter_node", "bandwidth_Bps"), "fast", "bandwidth_Bps"),
    (("inter_node", "bandwidth_Bps"), 0, "bandwidth_Bps"),
    (("inter_node", "latency_s"), -1, "latency_s"),
    (("nodes", "0", "devices_per_node"), _DROP, "devices_per_node"),
    (("nodes", "0", "devices_per_node"), "eight", "devices_per_node"),
    (("nodes", "0", "devices_per_node"), 0, "devices_per_node"),
    (("nodes", "0", "devices_per_node"), 2.5, "devices_per_node"),
    (("nodes", "0", "count"), 0, "count"),
    (("nodes", "0", "count"), "one", "count"),
    (("nodes", "0", "intra_node"), _DROP, "intra_node"),
    (("nodes", "0", "intra_node"), 5, "intra_node"),
    (("nodes", "0", "device"), _DROP, "device"),
    (("nodes", "0", "device", "name"), _DROP, "name"),
    (("nodes", "0", "device", "peak_flops"), _DROP, "peak_flops"),
    (("nodes", "0", "device", "peak_flops"), 1e13, "peak_flops"),
    (("nodes", "0", "device", "peak_flops"), {"fp64": 1e13}, "fp64"),
    (("nodes", "0", "device", "peak_flops"), {"fp32": -1}, "peak_flops"),
    (("nodes", "0", "device", "peak_flops"), {"fp32": "fast"}, "fast"),
    (("nodes", "0", "device", "memory_gib"), _DROP, "memory_"),
    (("nodes", "0", "device", "memory_gib"), "lots", "memory_gib"),
    (("nodes", "0", "device", "memory_gib"), 0, "memory_"),
    (("nodes", "0", "device", "memory_bytes"), 1 << 30, "memory_"),
    (("nodes", "0", "device", "efficiency"), 1.5, "efficiency"),
    (("nodes", "0", "device", "efficiency"), "high", "efficiency"),
    (("nodes", "0", "device", "memory_bandwidth_Bps"), 0, "memory_bandwidth_Bps"),
    (("nodes", "0", "processors"), 0, "processors"),
    (("nodes", "0", "sharing_efficiency"), 2.0, "sharing_efficiency"),
    (("nodes", "0", "gpus"), 8, "gpus"),
    (("nodes", "0", "preset"), "dgx-h200", "dgx-h200"),
    (("nodes", "0", "preset"), "dgx-h100", "preset"),
]  # fmt: skip


def _cluster_cases() -> list[Case]:
    cases = []
    for command in (("simulate",), ("plan", "--batch-size", "8")):
        for where, value, names in _CLUSTER_BAD:
            text = _cluster_toml(_mutated(where, value))
            label = ".".join(where) + (" missing" if value is _DROP else f"={value!r}")
            cases.append(_case(*command, "--cluster", "lab.toml", names=names,
                               files={"lab.toml": text}, label=label))  # fmt: skip
        cases += [
            _case(*command, "--cluster", "dgx-h200", names="dgx-h200"),
            _case(*command, "--cluster", "missing.toml", names="missing.toml"),
            _case(*command, "--cluster", "folder", names="folder"),
            _case(*command, "--cluster", "", names="cluster"),
            _case(*command, "--cluster", "lab.toml", names="lab.toml",
                  files={"lab.toml": "nodes = [[\n"}),
            _case(*command, "--cluster", "lab.toml", names="nodes", files={"lab.toml": ""}),
        ]  # fmt: skip
    return cases


# ---------------------------------------------------------------------------------------
# the model flags `profile`, `plan` and `simulate` share
_MODEL_FLAGS = [
    ("--layers", "0"), ("--layers", "x"), ("--hidden", "0"), ("--hidden", "-128"),
    ("--heads", "0"), ("--heads", "3"), ("--seq-len", "0"), ("--vocab", "0"),
    ("--ffn-hidden", "-1"), ("--micro-batch-size", "0"), ("--micro-batch-size", "1.5"),
    ("--model", "bert"),
]  # fmt: skip
_SIM = ("simulate", "--cluster", "local-cpu")
_PLAN = ("plan", "--cluster", "local-cpu", "--batch-size", "8")


def _command_cases() -> list[Case]:
    cases = []
    for command in (_SIM, _PLAN, ("profile", "--analytic")):
        cases += [_flag_case(*command, f, v, flag=f, value=v) for f, v in _MODEL_FLAGS]
    simulate = [
        ("--dp", "0"), ("--dp", "x"), ("--tp", "-1"), ("--pp", "0"), ("--pp", "7"),
        ("--microbatches", "0"), ("--chunks", "0"), ("--chunks", "2"), ("--schedule", "bogus"),
        ("--recompute", "some"), ("--zero", "4"), ("--zero", "-1"), ("--tp", "3"),
        ("--dtype", "fp64"), ("--dtype", "fp8"), ("--optimizer", "lamb"),
        ("--compress", "bogus"), ("--compress", "fp16"), ("--compress", "topk:2"),
        ("--trace", "folder"), ("--trace", "nowhere/t.json"), ("--plot", "folder"),
        ("--plot", "nowhere/t.png"),
    ]  # fmt: skip
    cases += [_flag_case(*_SIM, f, v, flag=f, value=v) for f, v in simulate]
    cases += [
        _case(*_SIM, "--schedule", "interleaved", "--chunks", "1", names="--chunks"),
        _case(*_SIM, "--dp", "2", "--zero", "3", "--schedule", "2bw", "--pp", "1",
              names=("zero", "2bw")),
        _case(*_SIM, "--tp", "2", "--heads", "3", "--hidden", "96", names="--tp"),
        _case(*_SIM, "--tp", "2", "--sequence-parallel", "--seq-len", "63", names="--seq-len"),
        _case("simulate", names="--cluster"),
    ]  # fmt: skip
    plan = [
        ("--nodes", "0"), ("--nodes", "x"), ("--devices", "-1"), ("--batch-size", "0"),
        ("--batch-size", "x"), ("--top", "0"), ("--dtype", "fp64"), ("--compress", "bogus"),
        ("--out", "folder"), ("--devices", "99999"), ("--wsp-staleness", "-1"),
        ("--wsp-staleness", "x"), ("--loader-rate", "-1"), ("--loader-rate", "nan"),
        ("--loader-rate", "inf"), ("--loader-rate", "x"),
    ]  # fmt: skip
    cases += [_flag_case(*_PLAN, f, v, flag=f, value=v) for f, v in plan]
    cases += [
        _case("plan", "--cluster", "local-cpu", names="--batch-size"),
        _case(*_PLAN, "--compress", "none,topk:0", names=("--compress", "topk:0")),
        _case("plan", "--cluster", "local-cpu", "--batch-size", "8", "--micro-batch-size",
              "3", names=("--batch-size", "--micro-batch-size")),
        _case("plan", "--cluster", "local-cpu", "--batch-size", "8", "--nodes", "2",
              names="--nodes"),
    ]  # fmt: skip
    profile = [
        ("--threads", "0"), ("--repeats", "0"), ("--warmup", "-1"), ("--dtype", "fp64"),
        ("--dtype", "fp8"), ("--cache-dir", "a-file"), ("--tp", "0"), ("--threads", "x"),
    ]  # fmt: skip
    cases += [_flag_case("profile", f, v, flag=f, value=v) for f, v in profile]
    cases += [
        _case("profile", "--analytic", "--tp", "0", names="--tp"),
        _flag_case("profile", "--analytic", "--tp", "3", flag="--tp", value="3"),
        _case("profile", "--sequence-parallel", names="--sequence-parallel"),
        _case("profile", "--analytic", "--threads", "4", names="--threads"),
        _case("profile", "--analytic", "--repeats", "9", names="--repeats"),
        _case("profile", "--analytic", "--no-cache", names="--no-cache"),
        _case("profile", "--analytic", "--cache-dir", "folder", names="--cache-dir"),
    ]
    return cases + _schedule_cases() + _bench_cases() + _checkpoint_cases() + _experiment_cases()


def _schedule_cases() -> list[Case]:
    base = ("schedule", "1f1b", "--pp", "4", "--microbatches", "8")
    cases = [
        _case("schedule", "bogus", "--pp", "2", "--microbatches", "4", names="bogus"),
        _case("schedule", "1f1b", "--microbatches", "4", names="--pp"),
        _case("schedule", "1f1b", "--pp", "0", "--microbatches", "4", names="--pp"),
        _case("schedule", "1f1b", "--pp", "x", "--microbatches", "4", names="--pp"),
        _case("schedule", "1f1b", "--pp", "2", "--microbatches", "-1", names="--microbatches"),
        _case(*base, "--chunks", "2", names="--chunks"),
        _case(*base, "--chunks", "0", names="--chunks"),
        _case("schedule", "interleaved", "--pp", "2", "--microbatches", "4", "--chunks", "1",
              names="--chunks"),
        _case(*base, "--windows", "0", names="--windows"),
        _case(*base, "--json", "--windows", "2", names="--windows"),
        _case(*base, "--json", "--program", names="--program"),
        _case(*base, "--windows", "x", names="--windows"),
        _case("schedule", "2bw", "--pp", "2", "--microbatches", "4", "--windows", "-2",
              names="--windows"),
    ]  # fmt: skip
    return cases


_BENCH: dict[str, list[tuple[tuple[str, ...], str | tuple[str, ...]]]] = {
    "pipeline": [
        (("--pp", "0"), "stages"), (("--microbatches", "0"), "microbatches"),
        (("--chunks", "0"), "chunks"), (("--chunks", "2"), "chunks"),
        (("--steps", "0"), "steps"), (("--warmup", "-1"), "warmup"), (("--layers", "0"), "layers"),
        (("--hidden", "0"), "hidden"), (("--heads", "3"), "heads"), (("--seq-len", "0"), "seq_len"),
        (("--batch-size", "7"), "batch_size"), (("--vocab", "0"), "vocab_size"),
        (("--schedule", "bogus"), "--schedule"), (("--pp", "x"), "--pp"),
        (("--pp", "4", "--microbatches", "2"), "microbatches"),
    ],
    "dp": [
        (("--workers", "0"), "workers"), (("--steps", "0"), "steps"),
        (("--warmup", "-1"), "warmup"), (("--optimizer", "lamb"), "--optimizer"),
        (("--batch-size", "7"), "batch_size"), (("--layers", "0"), "layers"),
        (("--heads", "3"), "heads"), (("--vocab", "-1"), "vocab_size"),
    ],
    "async": [
        (("--schedules", "pipedream"), "1f1b"), (("--schedules", "1f1b,bogus"), "bogus"),
        (("--pp", "0"), "stages"), (("--warmup", "-1"), "warmup"),
        (("--layers", "0"), "layers"), (("--hidden", "0"), "hidden"),
        (("--heads", "3"), "heads"), (("--batch-size", "6"), "batch_size"),
        (("--rounds", "0"), "rounds"), (("--seq-len", "0"), "seq_len"),
    ],
    "compress": [
        (("--workers", "x"), ("--workers", "'x'")), (("--workers", "1"), "workers"),
        (("--methods", "bogus"), "bogus"), (("--methods", "fp16"), "none"),
        (("--steps", "4"), "steps"), (("--warmup", "-1"), "warmup"),
        (("--layers", "0"), "layers"), (("--lr", "nan"), "lr"), (("--lr", "-1"), "lr"),
        (("--batch-size", "0"), "batch_size"), (("--optimizer", "lamb"), "--optimizer"),
        (("--hidden", "0"), "hidden"), (("--seq-len", "0"), "seq_len"),
        (("--warmup", "100"), "warmup"),
    ],
    "arrival": [
        (("--workers", "1"), "workers"), (("--sizes", "0"), "sizes"), (("--sizes", "x"), "--sizes"),
        (("--compute-ms", "-1"), "--compute-ms"), (("--jitter-ms", "nan"), "--jitter-ms"),
        (("--late-ms", "inf"), "--late-ms"), (("--calls", "0"), "calls"),
        (("--warmup", "-1"), "warmup"),
    ],
    "faults": [
        (("--trials", "0"), "trials"), (("--nproc", "1"), "nproc"), (("--every", "0"), "every"),
        (("--steps", "3"), "steps"), (("--trials", "x"), "--trials"),
        (("--modes", "1f1b,bogus"), "bogus"), (("--modes", ""), "modes"),
    ],
    "planner": [
        (("--workers", "1"), "workers"), (("--steps", "0"), "steps"),
        (("--warmup", "-1"), "warmup"), (("--heads", "3"), "heads"), (("--layers", "0"), "layers"),
        (("--hidden", "0"), "hidden"), (("--seq-len", "0"), "seq_len"),
        (("--batch-size", "0"), "batch_size"), (("--heads", "0"), "heads"),
    ],
    "sim-accuracy": [
        (("--schedules", "bogus"), "bogus"), (("--microbatches", "0"), "microbatches"),
        (("--microbatches", "x"), "--microbatches"), (("--worlds", "1"), "worlds"),
        (("--steps", "0"), "steps"), (("--layers", "0"), "layers"),
        (("--plot", "folder"), "--plot"), (("--trace-dir", "a-file"), "--trace-dir"),
        (("--hidden", "0"), "hidden"), (("--micro-batch-size", "0"), "micro_batch_size"),
    ],
}  # fmt: skip


def _bench_cases() -> list[Case]:
    cases = [_case("bench", "bogus", names="bogus")]
    for name, items in _BENCH.items():
        for argv, names in items:
            names = (names,) if isinstance(names, str) else names
            alternatives = {*names, *(f"--{n.replace('_', '-')}" for n in names)}
            cases.append(_case("bench", name, *argv, names=tuple(sorted(alternatives))))
    return cases


_CKPT = {"ckpt/plait.json": "{", "ckpt/.metadata": "", "ckpt/manifest.json": "{}"}


def _checkpoint_cases() -> list[Case]:
    return [
        _case("checkpoint", "inspect", "missing", names="missing"),
        _case("checkpoint", "inspect", "a-file", names="a-file"),
        _case("checkpoint", "inspect", "folder", names="folder"),
        _case("checkpoint", "inspect", "ckpt", names="ckpt", files=_CKPT),
        _case("checkpoint", "export", "missing", "--out", "m.pt", names="missing"),
        _case("checkpoint", "export", "folder", "--out", "m.pt", names="folder"),
        _case("checkpoint", "export", "ckpt", "--out", "folder", names="folder", files=_CKPT),
        _case("checkpoint", "export", "ckpt", "--out", "m.pt", names="ckpt", files=_CKPT),
        _case("checkpoint", "export", "ckpt", names="--out", files=_CKPT),
        _case("checkpoint", "bogus", names="bogus"),
    ]


def _experiment_cases() -> list[Case]:
    base = ("experiment", "staleness")
    items = [
        (("--pp", "x"), "--pp"), (("--pp", "0"), "stages"),
        (("--pp", ","), "stages"), (("--pp", "2,2"), "stages"),
        (("--schedules", "bogus"), "bogus"), (("--schedules", ""), "schedules"),
        (("--microbatches", "0"), "microbatches"), (("--microbatches", "x"), "--microbatches"),
        (("--budget", "5"), "budget"), (("--target", "-1"), "target"),
        (("--target", "nan"), "target"), (("--target", "x"), "--target"),
        (("--optimizer", "lamb"), "optimizer"), (("--lr", "0"), "lr"), (("--lr", "inf"), "lr"),
        (("--seed", "-1"), "seed"), (("--seed", "1.5"), "--seed"), (("--plot", "folder"), "--plot"),
        (("--plot", "nowhere/x.png"), "--plot"),
    ]  # fmt: skip
    return [_case(*base, *argv, names=names) for argv, names in items] + _seed_table_cases()


def _seed_table_cases() -> list[Case]:
    dp, dm, every = (
        ("experiment", "dp-vs-gpipe"),
        ("experiment", "data-movement"),
        ("experiment", "all", "--out", "out"),
    )
    items = [
        (dp, ("--workers", "x"), "--workers"), (dp, ("--workers", "0"), "workers"),
        (dp, ("--epochs", "0"), "epochs"), (dp, ("--data", "imagenet"), "imagenet"),
        (dp, ("--data", "cifar100:nowhere"), "nowhere"), (dp, ("--dtype", "fp8"), "fp8"),
        (dp, ("--images", "0"), "train_images"), (dp, ("--paper-cluster", "bogus"), "bogus"),
        (dp, ("--paper-chunks", "0"), "chunks"), (dp, ("--loader-rate", "-1"), "--loader-rate"),
        (dm, ("--models", "alexnet"), "alexnet"), (dm, ("--workers", "0"), "workers"),
        (dm, ("--batch-size", "5"), "batch_size"), (dm, ("--cluster", "bogus"), "bogus"),
        (dm, ("--steps", "x"), "--steps"), (every, ("--staleness-stages", "0"), "stages"),
        (every, ("--movement-models", "alexnet"), "alexnet"),
        (every, ("--staleness-layers", "0"), "num_layers"),
        (("experiment", "all"), (), "--out"),
        (("experiment", "all", "--out", "a-file"), (), "a-file"),
    ]  # fmt: skip
    return [_case(*base, *argv, names=names) for base, argv, names in items]


def _train_combination_cases() -> list[Case]:
    t = ("train", "--dry-run")
    return [
        _case(*t, "--tp", "3", names="tp=3"),
        _case(*t, "--schedule", "1f1b", "--chunks", "2", names="chunks=2"),
        _case(*t, "--schedule", "interleaved", "--chunks", "1", names="chunks=1"),
        _case(*t, "--sequence-parallel", "--pp", "2", names="sequence_parallel"),
        _case(*t, "--compress", "fp16", "--pp", "2", names="compress"),
        _case(*t, "--nesterov", "--pp", "2", names="nesterov"),
        _case(*t, "--min-lr", "0.1", names="min_lr"),
        _case(*t, "--profile-steps", "5:7", "--max-steps", "6", names="profile_steps"),
        _case(*t, "--profile-steps", "7:5", names="profile_steps"),
        _case(*t, "--max-restarts", "2", names="max_restarts"),
        _case(*t, "--pp", "7", names=("pp × chunks", "7")),
        _case(*t, "--batch-size", "30", "--pp", "2", names="batch_size=30"),
        _case(*t, "--partition", "2,2", "--pp", "2", names="partition"),
        _case(*t, "--model", "resnet18", "--data", "synthetic", "--tp", "2", "--pp", "1",
              names="tp=2"),
        _case(*t, "--model", "resnet18", "--data", "stdlib", names="stdlib"),
        _case(*t, "--data", "digits", names="digits"),
        _case(*t, "--data", "cifar100", "--model", "resnet18", names="cifar100"),
        _case(*t, "--data", "cifar100:missing", "--model", "resnet18", names="missing"),
        _case(*t, "--data", "stdlib:folder", names="stdlib:folder"),
        _case(*t, "--schedule", "2bw", "--tp", "2", "--pp", "2", "--nproc", "4", names="2bw"),
        _case(*t, "--schedule", "pipedream", "--dtype", "fp16", names="fp16"),
        _case(*t, "--hidden", "130", names=("hidden=130", "heads")),
        _case(*t, "--nproc", "3", "--dp", "2", names="nproc=3"),
        _case(*t, "--resume", "missing-checkpoint", names="missing-checkpoint"),
        _case(*t, "--tensorboard", "a-file", names="a-file"),
        _case(*t, "--config", "", names=("--config", "config file ''")),
        _case(*t, "--config", "missing.toml", names="missing.toml"),
        _case(*t, "--config", "folder", names="folder"),
        _case(*t, "--plan", "auto", "--pp", "2", "--schedule", "bogus", names="bogus"),
        _case("train", "--dry-run", "--bogus-flag", names="--bogus-flag"),
        _case("bogus-command", names="bogus-command"),
    ]  # fmt: skip


CASES = (
    _train_flag_cases()
    + _train_toml_cases()
    + _plan_cases(("train", "--dry-run"))
    + _plan_cases(("simulate",))
    + _train_combination_cases()
    + _cluster_cases()
    + _command_cases()
)

# ---------------------------------------------------------------------------------------
# values that look like mistakes but mean something (from the fields' help): 0 turns a
# feature off, -1 is the quiet verbosity, any integer is a seed
ACCEPTED = [
    ("--warmup-steps", "0"), ("--eval-batches", "0"), ("--sample-chars", "0"),
    ("--max-restarts", "0"), ("--verbosity", "-1"), ("--seed", "-3"), ("--momentum", "0"),
    ("--weight-decay", "0"), ("--min-lr", "0"), ("--dropout", "0"), ("--beta1", "0"),
    ("--zero", "0"), ("--grad-clip", "0"),
]  # fmt: skip

# settings that are accepted but change nothing in the run they are given to: each must
# warn (exit 0) or fail (exit 2), naming the setting
NO_EFFECT = [
    (("--momentum", "0.9"), "momentum"),
    (("--optimizer", "sgd", "--beta1", "0.8"), "beta1"),
    (("--optimizer", "sgd", "--eps", "1e-6"), "eps"),
    (("--min-lr", "0.001"), "min_lr"),
    (("--keep", "2"), "keep"),
    (("--eval-every", "5", "--eval-batches", "0"), "eval_every"),
    (("--allow-staleness", "--pp", "2"), "allow_staleness"),
    (("--width", "8"), "width"),
    (("--model", "resnet18", "--data", "synthetic", "--dropout", "0.1"), "dropout"),
    (("--model", "resnet18", "--data", "synthetic", "--layers", "8"), "layers"),
    (("--data", "synthetic", "--sample-chars", "50"), "sample_chars"),
    (("--resume", "auto"), "resume"),
    (("--pp", "2", "--flush-every", "2"), "flush_every"),
]  # fmt: skip


class _WorkStarted(BaseException):
    """Raised by the stand-ins of everything that starts work: no case may get there."""


def _refuse_work(*args: Any, **kwargs: Any) -> Any:
    raise _WorkStarted("work started before the input was refused")


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory with a file and a folder to misuse; work refused."""
    import plait.bench.arrival
    import plait.bench.asynchronous
    import plait.bench.compress
    import plait.bench.dp
    import plait.bench.faults
    import plait.bench.pipeline
    import plait.bench.planner
    import plait.bench.sim_accuracy
    import plait.cli.profile
    import plait.experiment.staleness

    for module in (plait.bench.arrival, plait.bench.asynchronous, plait.bench.compress,
                   plait.bench.dp, plait.bench.faults, plait.bench.pipeline, plait.bench.planner,
                   plait.bench.sim_accuracy):  # fmt: skip
        monkeypatch.setattr(module, "run_bench", _refuse_work)
    monkeypatch.setattr(plait.experiment.staleness, "run_experiment", _refuse_work)
    for name in ("dp_vs_gpipe", "data_movement"):
        monkeypatch.setattr(importlib.import_module(f"plait.experiment.{name}"),
                            "run_experiment", _refuse_work)  # fmt: skip
    monkeypatch.setattr(importlib.import_module("plait.experiment.report"), "run_all", _refuse_work)
    monkeypatch.setattr(plait.cli.profile, "_measure", _refuse_work)
    # plait.train re-exports the function `launch` under its module's name
    monkeypatch.setattr(importlib.import_module("plait.train.launch"), "launch", _refuse_work)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not inside a torchrun launch
    monkeypatch.delenv("RANK", raising=False)
    # main() sets the one-line warning format for its process: undo it after each case
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "folder").mkdir()
    return tmp_path


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in sorted(root.rglob("*"))}


def _run(argv: tuple[str, ...]) -> tuple[int, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            code = main(list(argv))
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, caught


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line(
    case: Case, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, text in case.files:
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text)
    before = _tree(workdir)
    code, _ = _run(case.argv)
    out, err = capsys.readouterr()
    assert code == 2, f"exit code {code}; stderr: {err!r}; stdout: {out[:300]!r}"
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert len(lines) == 1 or lines[0].startswith("usage: plait"), err  # argparse's form
    assert any(name in errors[0] for name in case.names), (case.names, errors[0])
    assert _tree(workdir) == before  # nothing written, nothing started


def test_the_sweep_is_large_and_covers_every_train_setting() -> None:
    assert len(CASES) >= 220
    assert len({c.id for c in CASES}) == len(CASES)
    for path in FIELDS:  # a new setting needs its meaning written into the tables above
        kind = _kind(path)
        assert kind != "int" or path in _INT_MIN, f"{path}: add its smallest value to _INT_MIN"
        assert kind != "float" or path in _FLOAT_RANGE, f"{path}: add its range to _FLOAT_RANGE"


@pytest.mark.parametrize(("flag", "value"), ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_values_that_mean_off_are_accepted(
    flag: str, value: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(workdir)
    code, caught = _run(("train", "--dry-run", "--pp", "2", flag, value))
    err = capsys.readouterr().err
    assert code == 0, err
    assert not caught, [str(w.message) for w in caught]
    assert _tree(workdir) == before


# a plan written by hand: no micro-batch size (train divides the global batch), no model
HAND_PLAN = {"dp": 1, "tp": 1, "pp": 2, "schedule": "gpipe", "microbatches": 2, "chunks": 1,
             "zero": 0, "recompute": "full", "dtype": "fp32", "partition": [1, 5],
             "global_batch": 8}  # fmt: skip


@pytest.mark.parametrize("plan", [GOOD_PLAN, HAND_PLAN], ids=["as written", "by hand"])
def test_a_good_plan_file_is_accepted(
    plan: dict[str, Any], workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (workdir / "p.json").write_text(json.dumps(plan))
    simulate = ("simulate", "--plan", "p.json", "--cluster", "local-cpu")
    for argv in (("train", "--dry-run", "--plan", "p.json"), simulate):
        code, caught = _run(argv)
        assert code == 0, capsys.readouterr().err
        assert not caught, [str(w.message) for w in caught]


@pytest.mark.parametrize(("argv", "name"), NO_EFFECT, ids=[" ".join(a) for a, _ in NO_EFFECT])
def test_a_setting_without_effect_warns_or_fails(
    argv: tuple[str, ...], name: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, caught = _run(("train", "--dry-run", *argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 2:
        assert name in err.strip().splitlines()[-1]
    else:
        assert code == 0, err
        assert any(name in str(w.message) for w in caught), [str(w.message) for w in caught]
