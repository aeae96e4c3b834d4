"""`plait train`: train a model on local workers, or inside an existing torchrun launch."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.train.launch import WorkerFailed, WorkerFailure

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train (default: a character-level GPT on the stdlib's source, 2 pipeline workers)",
        description="Train a GPT on the Python standard library's own source code. Without "
        "arguments: 2 local CPU workers, a 2-stage 1F1B pipeline, 300 steps. Run under torchrun "
        "to span several machines (the launch then comes from torchrun, not --nproc).",
    )
    from plait.cli.options import add_config_flags
    from plait.config import TrainConfig

    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file ([model], [parallel] sections, the rest top level) or a run's "
        "config.json (reproduces that run); flags override it",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        dest="dry_run",
        help="validate the settings, print the resolved configuration and exit",
    )
    add_config_flags(p, TrainConfig)
    # shorthands of --verbosity: same dest, so the last one given wins
    p.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1,
                   help="warnings only (--verbosity -1)")  # fmt: skip
    p.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                   help="debug details too (--verbosity 1)")  # fmt: skip
    p.set_defaults(func=run)


_LAYOUT_FLAGS = ("dp", "tp", "pp", "schedule", "microbatches", "chunks", "zero", "recompute",
                 "sequence_parallel", "partition")  # fmt: skip
_NOT_OVERRIDES = ("config", "func", "command", "dry_run")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
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
        adopted = _from_plan_file(str(plan), overrides, from_file)
        overrides.update(adopted)
        given |= set(adopted)
    overrides["plan"] = plan
    cfg = _load(args.config, overrides, given)
    _check_pretrained_shape(cfg, overrides, from_file)
    if nproc is not None and nproc != cfg.nproc:
        par = cfg.parallel
        if "parallel.pp" in given or nproc % (par.dp * par.tp):
            raise _noting_defaults(
                ValueError(
                    f"nproc={nproc} workers but dp × tp × pp = {par.dp} × {par.tp} × {par.pp} "
                    f"= {par.world_size}: make them equal"
                ),
                given,
            )
        pp = nproc // (par.dp * par.tp)
        blocks = cfg.model.layers + 2
        if cfg.model.known_blocks and pp * par.chunks > blocks:
            raise ValueError(
                f"nproc={nproc} workers would make a {pp}-stage pipeline (dp × tp = "
                f"{par.dp * par.tp}), but the model has {blocks} blocks: use at most "
                f"{blocks // par.chunks * par.dp * par.tp} workers, or more --dp/--tp/--layers"
            )
        overrides["parallel.pp"] = pp
        cfg = _load(args.config, overrides, given | {"parallel.pp"})
    _check_devices(cfg.nproc, cfg.device, env is not None)
    return cfg.to_dict()


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


def _from_plan_file(
    path: str, overrides: dict[str, Any], from_file: dict[str, Any]
) -> dict[str, Any]:
    """Config overrides that train under a plan file: its layout, its global batch and the
    model it was planned for; a model size set otherwise that differs is an error."""
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


def run(args: argparse.Namespace) -> int:
    from plait.mesh import launched_env, run_id
    from plait.train.launch import Interrupted, WorkerFailed, launch
    from plait.train.loop import train_worker

    cfg = _resolve(args)  # validated here, before any worker starts
    _check_user_model(cfg)
    env = launched_env()
    if env is not None:
        _check_torchrun_restarts(cfg)
    local = os.environ.get("LOCAL_WORLD_SIZE") if env is not None else None
    _check_memory(cfg, int(local or cfg["nproc"]))
    # every worker of a torchrun launch must agree on the folder: name it after the launch
    default = run_id() if env is not None else None
    run_dir = Path(
        str(cfg["run_dir"] or Path("runs") / (default or time.strftime("%Y%m%d-%H%M%S")))
    )
    _check_run_dir(run_dir)
    if args.dry_run:
        return _dry_run(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg["run_dir"] = str(run_dir)
    if env is None or env.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    if env is None:  # tokenize text once, here; torchrun's workers each find or make the cache
        _prepare_data(cfg)
    if env is not None:  # inside torchrun: this process is one worker
        summary = train_worker(cfg, str(run_dir))
        if summary is not None:
            _write_resolved(cfg, summary, run_dir)
            _report(summary, run_dir)
        return 0
    how = "planning the layout first" if cfg["plan"] == "auto" else "layout as given"
    print(f"plait train: {cfg['nproc']} workers ({how}), run folder {run_dir}")
    restarts = int(str(cfg.get("max_restarts") or 0))
    try:
        results = launch(
            train_worker,
            int(str(cfg["nproc"])),
            cfg,
            str(run_dir),
            max_restarts=restarts,
            on_restart=lambda failure, k: _restarting(failure, k, restarts, run_dir),
        )
    except WorkerFailed as err:
        print(f"plait train: error: {err}{_kept_traceback(err, run_dir)}", file=sys.stderr)
        return 1
    except Interrupted as err:
        from plait.checkpoint.store import published

        newest = published(run_dir / "checkpoints")
        kept = f"newest checkpoint {newest[0]}" if newest else "no checkpoint was published"
        print(f"plait train: {err}; workers stopped; {kept}", file=sys.stderr)
        return 128 + err.signum
    summary = next(s for s in results.values() if s is not None)
    _write_resolved(cfg, summary, run_dir)
    _report(summary, run_dir)
    return 0


def _check_user_model(cfg: dict[str, Any]) -> None:
    """A MODULE:FACTORY model can be found (it is built in the workers)."""
    name = cfg["model"]["name"]
    if ":" in name:
        from plait.models.user import load_factory

        load_factory(name)


def _prepare_data(cfg: dict[str, Any]) -> None:
    from plait.train.language import prepare_data
    from plait.train.loop import config_from_dict

    prepare_data(config_from_dict(cfg))


def _check_memory(cfg: dict[str, Any], local_workers: int) -> None:
    """Refuse a batch or sequence the workers cannot hold (a prediction, before they start)."""
    from plait.train.loop import config_from_dict
    from plait.train.memcheck import check_memory

    check_memory(config_from_dict(cfg), local_workers)


def _check_run_dir(run_dir: Path) -> None:
    """The run folder can be made (or reused) here, checked before any work starts."""
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(
                    f"--run-dir {run_dir}: {folder} is a file, not a folder; choose another path"
                )
            return


def _dry_run(cfg: dict[str, Any], run_dir: Path) -> int:
    """Print what a run would do, having validated it; start nothing."""
    par = cfg["parallel"]
    if cfg["plan"] == "auto":
        how = _preview(cfg)
    else:
        layout = ", ".join(f"{k}={v}" for k, v in par.items() if v is not None)
        how = f"layout {layout}"
    print(f"plait train --dry-run: valid; {cfg['nproc']} workers, {how}; run folder {run_dir}")
    print(json.dumps(cfg, indent=2))
    return 0


def _preview(cfg: dict[str, Any]) -> str:
    """The layout `--plan auto` would choose, planned here; for a model that needs a
    custom task (a user's module) the workers plan it."""
    from plait.train.autoplan import preview_plan
    from plait.train.loop import config_from_dict

    chosen = preview_plan(config_from_dict(cfg), int(cfg["nproc"]))
    layout = ", ".join(f"{k}={chosen[k]}" for k in ("dp", "tp", "pp", "schedule", "microbatches",
                                                     "chunks", "zero", "recompute"))  # fmt: skip
    step = chosen["predicted"]["step_time_s"]
    return (
        f"--plan auto would choose {layout} (predicted {step * 1e3:.1f} ms a step; the "
        "workers measure their links and plan again when they start)"
    )


def _write_resolved(cfg: dict[str, Any], summary: dict[str, Any], run_dir: Path) -> None:
    """Rewrite config.json as the configuration that ran: the layout the workers trained
    under (after auto-planning or a plan file), so `--config RUN/config.json` repeats it."""
    from plait.config import ParallelPlan

    resolved = dict(cfg)
    resolved["parallel"] = {**vars(ParallelPlan()), **summary["plan"]}
    resolved["plan"] = None
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))


def _check_torchrun_restarts(cfg: dict[str, Any]) -> None:
    """Under torchrun, torchrun restarts the workers (plait's workers only resume): a
    `--max-restarts` that torchrun was not given would silently not happen."""
    wanted = int(str(cfg.get("max_restarts") or 0))
    given = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if wanted > given:
        raise ValueError(
            f"--max-restarts {wanted} inside torchrun, which was started with "
            f"--max-restarts {given}: under torchrun the restarts are torchrun's; pass "
            f"--max-restarts {wanted} to torchrun (plait's workers resume by themselves)"
        )


def _restarting(failure: WorkerFailure, k: int, restarts: int, run_dir: Path) -> None:
    """The one line a restart prints: who failed, why, and where the run goes on from (the
    checkpoint every worker will choose: the newest good one)."""
    from plait.checkpoint.store import find

    found = find("auto", run_dir / "checkpoints")
    where = f"step {found.step}" if found is not None else "step 0 (no checkpoint yet)"
    print(
        f"plait train: rank {failure.rank} failed ({failure.cause}); "
        f"restart {k} of {restarts}, resuming from {where}",
        file=sys.stderr,
        flush=True,
    )


def _kept_traceback(err: WorkerFailed, run_dir: Path) -> str:
    """Write the failed worker's traceback into the run folder; the message's tail names it."""
    if not err.failure.traceback:
        return ""
    path = run_dir / f"failure-rank{err.failure.rank}.txt"
    path.write_text(err.failure.traceback)
    return f"; traceback in {path}"


def _report(summary: dict[str, Any], run_dir: Path) -> None:
    from plait.schedule import Schedule, compute_only, format_grid, unroll

    schedule = Schedule.from_dict(summary["schedule"])
    if schedule.policy == "sync":
        print("\nschedule each step ran (unit costs; rows are pipeline ranks):")
        print(format_grid(compute_only(schedule)))
    else:
        print("\nthe asynchronous stream, 3 windows with warm-up and drain (unit costs):")
        print(format_grid(compute_only(unroll(schedule, 3).schedule)))
    print(f"\nsample:\n{summary['sample']}\n")
    found = summary.get("validation", {})
    for name, value in found.items():  # a classifier's metrics, over the whole split
        if name not in ("loss", "samples"):
            print(f"validation {name}: {value:.4g} ({found['samples']} samples)")
    plan = summary["plan"]
    layout = ", ".join(f"{k}={v}" for k, v in plan.items() if k != "partition")
    print(
        f"plan ({summary['plan_source']}): {layout}\n"
        f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
        + (f", validation {summary['val_loss']:.3f}" if "val_loss" in summary else "")
        + " | "
        + f"step {summary['step_time_s'] * 1e3:.1f} ms | {summary['tokens_per_s']:,.0f} tok/s | "
        f"bubble {summary['bubble_fraction']:.1%} | peak memory "
        f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB (largest worker)"
    )
    print(
        f"run folder: {run_dir} (config.json, plan.json, schedule.json, metrics.jsonl, "
        "updates.jsonl, timeline.json, trace.json, timeline.png, summary.json)"
    )
