"""`plait train`'s config: the file, then the flags, then a plan file's layout and model,
validated before any worker starts; an error about a value nobody set says it was the
default."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["from_plan_file", "resolve"]

_LAYOUT_FLAGS = ("dp", "cp", "tp", "pp", "schedule", "microbatches", "chunks", "zero", "recompute",
                 "sequence_parallel", "partition")  # fmt: skip
_NOT_OVERRIDES = ("config", "func", "command", "dry_run")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The validated config: the file, then flags. With no layout given anywhere, the layout
    is planned on the workers (`--plan auto`); `--plan FILE` adopts a plan's layout and
    model; `--nproc` without `--pp` sets the pipeline degree. An error that involves a
    value nobody set says that value was the default."""
    from plait.config import read_config_file
    from plait.mesh import launched_env

    overrides = {k: v for k, v in vars(args).items() if k not in _NOT_OVERRIDES}
    nproc = overrides.pop("nproc", None)
    env = launched_env()
    if nproc is None and env is not None:
        nproc = env.world_size
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc {nproc} must be at least 1 (local worker processes)")
    from_file = read_config_file(args.config) if args.config else {}
    given = _given(from_file, overrides)
    layout_given = any(f"parallel.{k}" in given for k in _LAYOUT_FLAGS)
    plan = overrides.pop("plan", None) or from_file.get("plan")
    plan = plan or (None if layout_given else "auto")
    device = str(overrides.get("device") or from_file.get("device") or "auto")
    if nproc is None and plan == "auto":  # a GPU host: one worker per GPU, unless told
        nproc = _gpu_workers(device)
    if plan not in (None, "auto"):
        adopted = from_plan_file(str(plan), overrides, from_file)
        overrides.update(adopted)
        given |= set(adopted)
    overrides["plan"] = plan
    cfg = _load(args.config, overrides, given)
    _check_pretrained_shape(cfg, overrides, from_file)
    if nproc is not None and nproc != cfg.nproc:
        par = cfg.parallel
        if "parallel.pp" in given or nproc % (par.dp * par.cp * par.tp):
            raise _noting_defaults(
                ValueError(
                    f"nproc={nproc} workers but {_product(par)} = {par.world_size}: make them equal"
                ),
                given,
            )
        pp = nproc // (par.dp * par.cp * par.tp)
        blocks = cfg.model.layers + 2
        if cfg.model.known_blocks and pp * par.chunks > blocks:
            raise ValueError(
                f"nproc={nproc} workers would make a {pp}-stage pipeline (dp × cp × tp = "
                f"{par.dp * par.cp * par.tp}), but the model has {blocks} blocks: use at most "
                f"{blocks // par.chunks * par.dp * par.cp * par.tp} workers, or more "
                "--dp/--cp/--tp/--layers"
            )
        overrides["parallel.pp"] = pp
        cfg = _load(args.config, overrides, given | {"parallel.pp"})
    _check_devices(cfg.nproc, cfg.device, env is not None)
    from plait.train.slowdown import check_config

    check_config(cfg)
    if cfg.parallel.cp > 1:  # refused here, before any worker starts
        from plait.train.context import cp_refusal

        why = cp_refusal(cfg.parallel)
        if why is not None:
            raise ValueError(why)
    return cfg.to_dict()


def _product(par: Any) -> str:
    """The plan's degrees as the world size multiplies them (cp named only when used)."""
    names = ("dp", "cp", "tp", "pp") if par.cp > 1 else ("dp", "tp", "pp")
    return " × ".join(names) + " = " + " × ".join(str(getattr(par, n)) for n in names)


def _gpu_workers(device: str) -> int | None:
    """The worker count on a host with GPUs when none is given: one per GPU (None on CPU
    workers, where the layout decides)."""
    from plait.device import default_workers

    return default_workers(device)


def _check_devices(nproc: int, device: str, torchrun: bool) -> None:
    """Each worker on this host gets a GPU of its own (checked before any worker starts)."""
    from plait.device import check_workers

    local = os.environ.get("LOCAL_WORLD_SIZE") if torchrun else None
    check_workers(nproc, device, local=int(local) if local else None)


def _check_pretrained_shape(cfg: Any, overrides: dict[str, Any], from_file: dict[str, Any]) -> None:
    """Under --init-from, a model setting given (even equal to its default) that differs
    from the folder's is an error (the config alone sees only non-default values)."""
    if cfg.init_from is None:
        return
    flags = {k[6:]: v for k, v in overrides.items() if k.startswith("model.") and v is not None}
    given = {**from_file.get("model", {}), **flags}
    for name in ("name", "layers", "hidden", "heads", "ffn_hidden"):
        if name in given and given[name] != getattr(cfg.model, name):
            flag = "--model" if name == "name" else "--" + name.replace("_", "-")
            raise ValueError(
                f"{name}={given[name]!r} contradicts --init-from {cfg.init_from}, whose "
                f"config.json gives {getattr(cfg.model, name)!r}: drop {flag} (the folder "
                "decides the model's shape)"
            )


def _given(from_file: dict[str, Any], overrides: dict[str, Any]) -> set[str]:
    """The dotted names of the settings the user set, in the file or as flags."""
    given = {k for k, v in overrides.items() if v is not None}
    for key, value in from_file.items():
        if isinstance(value, dict):
            given |= {f"{key}.{k}" for k in value}
        else:
            given.add(key)
    return given


def _load(path: str | None, overrides: dict[str, Any], given: set[str]) -> Any:
    from plait.config import load_config

    try:
        return load_config(path, **overrides)
    except ValueError as err:
        raise _noting_defaults(err, given) from None


def _noting_defaults(err: ValueError, given: set[str]) -> ValueError:
    """`err` with the defaulted values it mentions named as defaults, with their flags."""
    import re

    from plait.cli.options import config_flags
    from plait.config import TrainConfig

    text, defaults = str(err), TrainConfig(plan="auto")
    noted = []
    for path, flag in config_flags(TrainConfig).items():
        name = path.rpartition(".")[2]
        if path in given or name == "nproc" or not re.search(rf"\b{name}\b", text):
            continue
        section, _, _ = path.partition(".")
        owner = getattr(defaults, section) if "." in path else defaults
        noted.append(f"{name}={getattr(owner, name)!r} ({flag})")
    if not noted:
        return err
    return ValueError(f"{text} [not given, so the default: {', '.join(noted)}]")


# the plan file's model keys training adopts (a plan for a MoE model also names it and
# its experts; a dense plan's "gpt" stands for any dense transformer, so it is not adopted)
_PLAN_MODEL = ("layers", "hidden", "heads", "seq_len", "ffn_hidden", "experts", "top_k",
               "capacity_factor", "moe_every", "shared_expert")  # fmt: skip


def from_plan_file(
    path: str, overrides: dict[str, Any], from_file: dict[str, Any]
) -> dict[str, Any]:
    """Config overrides that train under a plan file: its layout, its global batch and the
    model it was planned for; a model size set otherwise that differs is an error."""
    from plait.config.sections import flat_plan_file
    from plait.plan.io import parallel_plan_of, read_plan

    if not Path(path).is_file():
        raise ValueError(f"plan file {path} does not exist (write one with `plait plan --out`)")
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"plan file {path} is not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model", {}), dict):
        raise ValueError(f"plan file {path}: its model must be an object of sizes (layers, ...)")
    try:  # type-checked as the config is: a string where a count belongs is an error
        data = flat_plan_file(data, f"plan file {path}")
        layout = parallel_plan_of(data)
    except ValueError as err:
        raise ValueError(f"plan file {path}: {err}") from None
    read_plan(path)  # the rest of what a plan file must hold
    out: dict[str, Any] = {f"parallel.{k}": v for k, v in vars(layout).items()}
    if overrides.get("batch_size") is None and "batch_size" not in from_file:
        out["batch_size"] = int(data.get("global_batch", 0)) or None
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"plan file {path}: model={model!r} must be an object of sizes")
    mine = dict(from_file.get("model", {}))
    mine.update(
        {k[6:]: v for k, v in overrides.items() if k.startswith("model.") and v is not None}
    )
    keys = (*_PLAN_MODEL, "name") if model.get("name") == "moe-gpt" else _PLAN_MODEL
    differ = [f"{k}: plan {model[k]}, given {mine[k]}" for k in keys
              if k in model and k in mine and mine[k] != model[k]]  # fmt: skip
    if differ:
        raise ValueError(
            f"plan file {path} was made for another model ({'; '.join(differ)}): drop those "
            "settings to train the plan's model, or plan again for yours"
        )
    for key in keys:
        if model.get(key) is not None:
            out[f"model.{key}"] = model[key]
    return out
