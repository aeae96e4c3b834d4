"""`plait train`: train a model on local workers, or inside an existing torchrun launch."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

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
        "--schedule", dest="parallel.schedule", choices=["gpipe", "1f1b", "interleaved", "zb-h1"]
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
    p.add_argument("--layers", type=int, dest="model.layers")
    p.add_argument("--hidden", type=int, dest="model.hidden")
    p.add_argument("--heads", type=int, dest="model.heads")
    p.add_argument("--seq-len", type=int, dest="model.seq_len")
    p.add_argument("--sample-chars", type=int, dest="sample_chars")
    p.set_defaults(func=run)


def _resolve(args: argparse.Namespace) -> dict[str, object]:
    """The validated config: TOML, then flags; `--nproc` alone sets the pipeline degree."""
    from plait.config import load_config
    from plait.mesh import launched_env

    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "func", "command")}
    nproc = overrides.pop("nproc", None)
    env = launched_env()
    if nproc is None and env is not None:
        nproc = env.world_size
    cfg = load_config(args.config, **overrides)
    if nproc is not None and nproc != cfg.nproc:
        degrees_given = any(overrides.get(f"parallel.{k}") is not None for k in ("dp", "tp", "pp"))
        par = cfg.parallel
        if degrees_given or nproc % (par.dp * par.tp):
            raise ValueError(
                f"nproc={nproc} workers but dp × tp × pp = {par.dp} × {par.tp} × {par.pp} = "
                f"{par.world_size}: make them equal"
            )
        overrides["parallel.pp"] = nproc // (par.dp * par.tp)
        cfg = load_config(args.config, **overrides)
    return cfg.to_dict()


def run(args: argparse.Namespace) -> int:
    from plait.mesh import launched_env, run_id
    from plait.schedule import build
    from plait.train import launch
    from plait.train.loop import train_worker

    cfg = _resolve(args)  # validated here, before any worker starts
    pipe = cfg["parallel"]
    assert isinstance(pipe, dict)
    schedule = build(pipe["schedule"], pipe["pp"], pipe["microbatches"], pipe["chunks"])
    env = launched_env()
    # every worker of a torchrun launch must agree on the folder: name it after the launch
    default = run_id() if env is not None else None
    run_dir = Path(
        str(cfg["run_dir"] or Path("runs") / (default or time.strftime("%Y%m%d-%H%M%S")))
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg["run_dir"] = str(run_dir)
    if env is None or env.rank == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        (run_dir / "schedule.json").write_text(schedule.to_json())
    if env is not None:  # inside torchrun: this process is one worker
        summary = train_worker(cfg, str(run_dir))
        if summary is not None:
            _report(summary, run_dir, schedule)
        return 0
    print(f"plait train: {cfg['nproc']} workers, run folder {run_dir}")
    results = launch(train_worker, int(str(cfg["nproc"])), cfg, str(run_dir))
    summary = next(s for s in results.values() if s is not None)
    _report(summary, run_dir, schedule)
    return 0


def _report(summary: dict[str, Any], run_dir: Path, schedule: object) -> None:
    from plait.schedule import Schedule, compute_only, format_grid

    assert isinstance(schedule, Schedule)
    print("\nschedule each step ran (unit costs; rows are ranks):")
    print(format_grid(compute_only(schedule)))
    print(f"\nsample:\n{summary['sample']}\n")
    plan = summary["plan"]
    print(
        f"plan {plan} | loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} | "
        f"step {summary['step_time_s'] * 1e3:.1f} ms | {summary['tokens_per_s']:,.0f} tok/s | "
        f"bubble {summary['bubble_fraction']:.1%} | peak memory "
        f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB (largest worker)"
    )
    print(
        f"run folder: {run_dir} (config.json, schedule.json, metrics.jsonl, timeline.json, "
        "summary.json)"
    )
