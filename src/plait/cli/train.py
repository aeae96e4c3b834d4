"""`plait train`: train a model on local workers, or inside an existing torchrun launch."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.cli.train_config import resolve

if TYPE_CHECKING:
    from plait.train.launch import WorkerFailed, WorkerFailure

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        usage="%(prog)s [-h] [--config FILE] [--dry-run] [FLAG ...] (flags by section below)",
        help="train a model on local workers (default: a character-level GPT on the stdlib's "
        "source, layout planned)",
        description="Train a model on local workers; by default a character-level GPT on the "
        "Python standard library's own source code. With no layout given (--dp, --tp, --pp, "
        "--schedule, ...) it runs --plan auto: the workers profile the model, the planner "
        "chooses the layout and they train under it (on CPU 2 workers, on a GPU host one per "
        "GPU), 300 steps. Run under torchrun to span several machines (the launch then comes "
        "from torchrun, not --nproc).",
    )
    from plait.cli.options import add_config_flags, add_groups
    from plait.config import TrainConfig

    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file ([model], [layout], [pipeline], [memory], [numerics], "
        "[communication], the rest top level) or a run's config.json (reproduces that "
        "run); flags override it",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        dest="dry_run",
        help="validate the settings, print the resolved configuration and exit",
    )
    groups = add_groups(p)
    add_config_flags(p, TrainConfig, groups=groups)
    # shorthands of --verbosity: same dest, so the last one given wins
    logging_flags = groups["logging"]
    logging_flags.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=-1,
        help="warnings and the final summary only (--verbosity -1)",
    )
    logging_flags.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                               help="debug details too (--verbosity 1)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`plait train`; stopped by Ctrl-C (or SIGTERM) at any moment, it prints one line: the
    newest checkpoint and the command that resumes from it."""
    import signal

    from plait.train.launch import Interrupted

    started: dict[str, Any] = {}  # the run's config once its folder holds config.json
    try:
        return _run(args, started)
    except KeyboardInterrupt:  # before the workers' launch, or between attempts
        err = Interrupted(signal.SIGINT)
    except Interrupted as caught:
        err = caught
    print(f"plait train: {err}; {_stopped(started.get('cfg'))}", file=sys.stderr)
    return 128 + err.signum


def _stopped(cfg: dict[str, Any] | None) -> str:
    """The rest of the line a stopped run prints: what is kept and how to go on."""
    if cfg is None:
        return "nothing was started"
    from plait.checkpoint.store import published

    run_dir = Path(cfg["run_dir"])
    again = f"plait train --config {run_dir / 'config.json'}"
    newest = published(run_dir / "checkpoints")
    if newest:
        return f"workers stopped; newest checkpoint {newest[0]}; resume: {again} --resume auto"
    if cfg.get("checkpoint_every") is None:
        return f"workers stopped; no checkpoints (--checkpoint-every N); run again: {again}"
    return f"workers stopped; no checkpoint published yet; run again: {again} --resume auto"


def _run(args: argparse.Namespace, started: dict[str, Any]) -> int:
    from plait.mesh import launched_env, run_id
    from plait.train.launch import WorkerFailed, launch
    from plait.train.start import train_worker

    cfg = resolve(args)  # validated here, before any worker starts
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
        from plait.config.sections import to_file

        (run_dir / "config.json").write_text(json.dumps(to_file(cfg), indent=2))
        started["cfg"] = cfg
    if env is None:  # tokenize text once, here; torchrun's workers each find or make the cache
        _prepare_data(cfg)
    if env is not None:  # inside torchrun: this process is one worker
        return _torchrun_worker(cfg, run_dir, env.rank)
    how = "planning the layout first" if cfg["plan"] == "auto" else "layout as given"
    if cfg["verbosity"] >= 0:
        print(f"plait train: {cfg['nproc']} workers ({how}), run folder {run_dir}", flush=True)
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
    summary = next(s for s in results.values() if s is not None)
    _write_resolved(cfg, summary, run_dir)
    _report(summary, run_dir, quiet=cfg["verbosity"] < 0)
    return 0


def _torchrun_worker(cfg: dict[str, Any], run_dir: Path, rank: int) -> int:
    """One worker of a torchrun launch. Its failure ends it with one line naming its rank,
    its node and the cause (a lost or stalled peer's rank and node too), the traceback in
    the run folder; torchrun's own report follows."""
    from plait.train.launch import WorkerFailed, WorkerFailure
    from plait.train.loop import train_worker

    try:
        summary = train_worker(cfg, str(run_dir))
    except (KeyboardInterrupt, ValueError):
        raise
    except Exception as err:
        import traceback

        from plait.heartbeat import explain_lost

        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        cause = explain_lost(cause[:400])  # a broken connection: which rank is gone
        failed = WorkerFailed(WorkerFailure(rank, cause, traceback.format_exc()), 0)
        line = _with_nodes(f"{failed}{_kept_traceback(failed, run_dir)}")
        print(f"plait train: error: {line}", file=sys.stderr, flush=True)
        return 1
    if summary is not None:
        _write_resolved(cfg, summary, run_dir)
        _report(summary, run_dir, quiet=cfg["verbosity"] < 0)
    return 0


def _with_nodes(text: str) -> str:
    """`text` with each "rank N" followed by its node, under torchrun ("rank 1 (node 1)")."""
    import re

    from plait.mesh import node_of

    def named(match: re.Match[str]) -> str:
        node = node_of(int(match.group(1)))
        return match.group(0) if node is None else f"{match.group(0)} (node {node})"

    return re.sub(r"\brank (\d+)\b", named, text)


def _check_user_model(cfg: dict[str, Any]) -> None:
    """A MODULE:FACTORY model can be found (it is built in the workers)."""
    name = cfg["model"]["name"]
    if ":" in name:
        from plait.models.user import load_factory

        load_factory(name)


def _prepare_data(cfg: dict[str, Any]) -> None:
    from plait.config import config_from_dict
    from plait.train.language import prepare_data

    prepare_data(config_from_dict(cfg))


def _check_memory(cfg: dict[str, Any], local_workers: int) -> None:
    """Refuse a batch or sequence the workers cannot hold (a prediction, before they start)."""
    from plait.config import config_from_dict
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
    from plait.mesh import launched_env

    par = cfg["parallel"]
    if cfg["plan"] == "auto" and launched_env() is not None:
        how = "--plan auto: the workers decide the layout when the run starts"
    elif cfg["plan"] == "auto":
        how = _preview(cfg)
    else:
        layout = ", ".join(f"{k}={v}" for k, v in par.items() if v is not None)
        how = f"layout {layout}"
    print(f"plait train --dry-run: valid; {cfg['nproc']} workers, {how}; run folder {run_dir}")
    from plait.config.sections import to_file

    print(json.dumps(to_file(cfg), indent=2))  # as config.json holds it
    return 0


def _preview(cfg: dict[str, Any]) -> str:
    """The layout `--plan auto` chooses: the one kept for these flags on this host
    (`plait.train.decisions`), else one planned here and kept, so that the run with
    these flags trains under exactly this plan."""
    from plait.config import config_from_dict
    from plait.train.autoplan import preview_plan

    chosen = preview_plan(config_from_dict(cfg), int(cfg["nproc"]))
    layout = ", ".join(f"{k}={chosen[k]}" for k in ("dp", "tp", "pp", "schedule", "microbatches",
                                                     "chunks", "zero", "recompute"))  # fmt: skip
    if chosen.get("pipelines"):  # pipelines of their own: each one's depth and share
        depths = "+".join(str(len(p["partition"])) for p in chosen["pipelines"])
        shares = "+".join(str(p["microbatches"]) for p in chosen["pipelines"])
        layout += f", pipelines of depths {depths} with {shares} micro-batches"
    step = chosen["predicted"]["step_time_s"]
    decision = chosen.get("decision", {})
    if decision.get("source") != "kept":
        how = "planned now"
    elif decision.get("kept_from") == "measured":
        how = "decided earlier by the workers of a run with these flags on this host"
    else:
        how = "planned earlier for these flags on this host"
    where = f"; kept in {decision['file']}" if decision.get("file") else ""
    return (
        f"--plan auto chooses {layout} (predicted {step * 1e3:.1f} ms a step; {how}{where}; "
        "`plait train` with these flags trains under it; --replan decides again)"
    )


def _write_resolved(cfg: dict[str, Any], summary: dict[str, Any], run_dir: Path) -> None:
    """Rewrite config.json as the configuration that ran: the layout the workers trained
    under (after auto-planning or a plan file), so `--config RUN/config.json` repeats it."""
    from plait.config import ParallelPlan
    from plait.config.sections import to_file

    resolved = dict(cfg)
    resolved["parallel"] = {**vars(ParallelPlan()), **summary["plan"]}
    resolved["plan"] = None
    (run_dir / "config.json").write_text(json.dumps(to_file(resolved), indent=2))


def _check_torchrun_restarts(cfg: dict[str, Any]) -> None:
    """Under torchrun, torchrun restarts the workers (plait's workers only resume): a
    `--max-restarts` that torchrun was not given would silently not happen, and one it
    was given fails at the restart unless its agents' shared store is turned off."""
    wanted = int(str(cfg.get("max_restarts") or 0))
    given = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if wanted > given:
        raise ValueError(
            f"--max-restarts {wanted} inside torchrun, which was started with "
            f"--max-restarts {given}: under torchrun the restarts are torchrun's; pass "
            f"--max-restarts {wanted} to torchrun (plait's workers resume by themselves)"
        )
    if given > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch keeps the agent's store across rendezvous rounds without a per-round prefix
        raise ValueError(
            f"torchrun --max-restarts {given} with the store its agents share: a restarted "
            "worker group reads the addresses the group before it left there and cannot "
            "connect (pytorch/pytorch#135712); start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment on every node"
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
    try:
        path.write_text(err.failure.traceback)
    except OSError as cannot:  # the run folder's disk is full or read-only (the failure?)
        return f"; traceback not kept ({cannot.strerror} writing {path})"
    return f"; traceback in {path}"


def _report(summary: dict[str, Any], run_dir: Path, *, quiet: bool = False) -> None:
    """The end of a run: the schedule it ran and a sample (not under -q), then the summary."""
    from plait.schedule import Schedule, compute_only, format_grid, unroll
    from plait.train.logs import describe_layout

    schedule = Schedule.from_dict(summary["schedule"])
    if not quiet:
        if schedule.policy == "sync":
            print("\nschedule each step ran (unit costs; rows are pipeline ranks):")
            print(format_grid(compute_only(schedule)))
        else:
            print("\nthe asynchronous stream, 3 windows with warm-up and drain (unit costs):")
            print(format_grid(compute_only(unroll(schedule, 3).schedule)))
        if summary["sample"]:
            print(f"\nsample:\n{summary['sample']}\n")
    found = summary.get("validation", {})
    for name, value in found.items():  # a classifier's metrics, over the whole split
        if name not in ("loss", "samples"):
            print(f"validation {name}: {value:.4g} ({found['samples']} samples)")
    print(
        f"plan ({summary['plan_source']}): {describe_layout(summary['plan'])}\n"
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
