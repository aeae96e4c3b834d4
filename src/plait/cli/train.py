"""`plait train`: train a model on local workers, or inside an existing torchrun launch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.schedule.registry import KINDS

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
    p.add_argument("--config", help="TOML file ([model], [parallel] sections, the rest top level)")
    p.add_argument("--max-steps", type=int, dest="max_steps")
    p.add_argument("--run-dir", dest="run_dir", help="output folder (default: a new runs/<time>)")
    p.add_argument("--nproc", type=int, help="local worker processes (default dp × tp × pp)")
    p.add_argument("--batch-size", type=int, dest="batch_size")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--dp", type=int, dest="parallel.dp", help="data-parallel degree")
    p.add_argument("--tp", type=int, dest="parallel.tp", help="tensor-parallel degree")
    p.add_argument("--pp", type=int, dest="parallel.pp", help="pipeline degree")
    p.add_argument(
        "--schedule",
        dest="parallel.schedule",
        choices=list(KINDS),
        metavar="KIND",
        help="pipeline schedule: " + "; ".join(f"{k.name} ({k.summary})" for k in KINDS.values()),
    )
    p.add_argument("--microbatches", type=int, dest="parallel.microbatches")
    p.add_argument("--chunks", type=int, dest="parallel.chunks", help="virtual stages per rank")
    p.add_argument(
        "--zero",
        type=int,
        dest="parallel.zero",
        choices=[0, 1, 2, 3],
        help="ZeRO stage of data parallelism (2 and 3 through FSDP2)",
    )
    p.add_argument("--recompute", dest="parallel.recompute", choices=["none", "selective", "full"])
    p.add_argument(
        "--sequence-parallel", action="store_const", const=True, dest="parallel.sequence_parallel"
    )
    p.add_argument("--dtype", dest="parallel.dtype", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--grad-clip", type=float, dest="grad_clip")
    p.add_argument(
        "--plan",
        help="'auto' (default when no layout is given): profile, plan and train; or a plan "
        "file from `plait plan --out`",
    )
    p.add_argument(
        "--allow-staleness",
        action="store_const",
        const=True,
        dest="allow_staleness",
        help="let --plan auto choose an asynchronous schedule (updates on stale weights)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        dest="checkpoint_every",
        metavar="N",
        help="save a checkpoint every N steps (in the background) under RUN_DIR/checkpoints",
    )
    p.add_argument("--keep", type=int, metavar="K", help="keep the newest K checkpoints")
    p.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="resume from the newest good checkpoint of --run-dir ('auto') or a checkpoint "
        "folder; any layout loads any checkpoint",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        dest="max_restarts",
        metavar="R",
        help="restart the workers up to R times after one dies, resuming from the newest good "
        "checkpoint (needs --checkpoint-every)",
    )
    p.add_argument(
        "--log-every",
        type=int,
        dest="log_every",
        metavar="N",
        help="flush metrics.jsonl every N steps (default 10)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        dest="timeout_s",
        metavar="SECONDS",
        help="longest wait for another worker before the run fails naming it (default 300)",
    )
    p.add_argument("--layers", type=int, dest="model.layers")
    p.add_argument("--hidden", type=int, dest="model.hidden")
    p.add_argument("--heads", type=int, dest="model.heads")
    p.add_argument("--seq-len", type=int, dest="model.seq_len")
    p.add_argument("--sample-chars", type=int, dest="sample_chars")
    p.set_defaults(func=run)


_LAYOUT_FLAGS = ("dp", "tp", "pp", "schedule", "microbatches", "chunks", "zero", "recompute",
                 "sequence_parallel")  # fmt: skip


def _resolve(args: argparse.Namespace) -> dict[str, object]:
    """The validated config: TOML, then flags. With no layout given anywhere, the layout is
    planned on the workers (`--plan auto`); `--plan FILE` reads one; `--nproc` alone
    sets the pipeline degree."""
    import tomllib

    from plait.config import load_config
    from plait.mesh import launched_env

    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "func", "command")}
    nproc = overrides.pop("nproc", None)
    env = launched_env()
    if nproc is None and env is not None:
        nproc = env.world_size
    plan = overrides.pop("plan", None)
    from_file = tomllib.loads(Path(args.config).read_text()) if args.config else {}
    layout_given = "parallel" in from_file or any(
        overrides.get(f"parallel.{k}") is not None for k in _LAYOUT_FLAGS
    )
    plan = plan or from_file.get("plan") or (None if layout_given else "auto")
    if plan not in (None, "auto"):
        overrides.update(_from_plan_file(str(plan), overrides))
    overrides["plan"] = plan
    cfg = load_config(args.config, **overrides)
    if nproc is not None and nproc != cfg.nproc:
        par = cfg.parallel
        if (
            (layout_given and plan is None)
            or plan not in (None, "auto")
            or nproc % (par.dp * par.tp)
        ):
            raise ValueError(
                f"nproc={nproc} workers but dp × tp × pp = {par.dp} × {par.tp} × {par.pp} = "
                f"{par.world_size}: make them equal"
            )
        overrides["parallel.pp"] = nproc // (par.dp * par.tp)
        cfg = load_config(args.config, **overrides)
    return cfg.to_dict()


def _from_plan_file(path: str, overrides: dict[str, object]) -> dict[str, object]:
    """Config overrides that train under a plan file (its layout and its global batch)."""
    from plait.plan.io import read_plan
    from plait.train.autoplan import parallel_plan_from

    data = read_plan(path)
    layout = parallel_plan_from(data)
    out: dict[str, object] = {f"parallel.{k}": v for k, v in vars(layout).items()}
    if overrides.get("batch_size") is None:
        out["batch_size"] = int(data.get("global_batch", 0)) or None
    return out


def run(args: argparse.Namespace) -> int:
    from plait.mesh import launched_env, run_id
    from plait.train.launch import Interrupted, WorkerFailed, launch
    from plait.train.loop import train_worker

    cfg = _resolve(args)  # validated here, before any worker starts
    env = launched_env()
    if env is not None:
        _check_torchrun_restarts(cfg)
    # every worker of a torchrun launch must agree on the folder: name it after the launch
    default = run_id() if env is not None else None
    run_dir = Path(
        str(cfg["run_dir"] or Path("runs") / (default or time.strftime("%Y%m%d-%H%M%S")))
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg["run_dir"] = str(run_dir)
    if env is None or env.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    if env is not None:  # inside torchrun: this process is one worker
        summary = train_worker(cfg, str(run_dir))
        if summary is not None:
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
    _report(summary, run_dir)
    return 0


def _check_torchrun_restarts(cfg: dict[str, Any]) -> None:
    """Under torchrun, torchrun restarts the workers (plait's workers only resume): a
    `--max-restarts` that torchrun was not given would silently not happen."""
    import os

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
    for name, value in summary.get("validation", {}).items():  # a classifier's metrics
        print(f"validation {name}: {value:.4g}")
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
        "updates.jsonl, timeline.json, summary.json)"
    )
