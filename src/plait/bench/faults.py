"""Faults: kill a random worker of `plait train` at a random step; count recoveries.

Each trial runs `plait train --checkpoint-every N --max-restarts 1` as its own process,
waits until the run has finished a step chosen at random, and kills one of its workers,
chosen at random, with SIGKILL (no chance to clean up, as when a machine or the OOM killer
takes it). The run must restart, resume from its newest good checkpoint, finish, and end
with weights equal bit for bit to those of one uninterrupted run of the same command
(compared on the exported final checkpoints). Recovery time is from the kill to the end
of the first step after the restart; lost steps are the steps finished before the kill
that were run again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from plait.bench import _common as common

__all__ = ["FaultsConfig", "run_bench", "train_command", "workers_of"]

_RESTART = re.compile(r"rank (\d+) failed \((.+)\); restart 1 of \d+, resuming from step (\d+)")


@dataclass(frozen=True)
class FaultsConfig:
    trials: int = 20
    nproc: int = 2  # pipeline stages (local workers)
    steps: int = 24
    every: int = 4  # checkpoint cadence
    seed: int = 0
    model: str = "--layers 2 --hidden 64 --seq-len 32 --batch-size 16 --sample-chars 1"
    trial_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.trials < 1 or self.nproc < 2:
            raise ValueError(
                f"trials={self.trials}, nproc={self.nproc}: give ≥ 1 trial, ≥ 2 workers"
            )
        if not 1 <= self.every < self.steps - 1:
            raise ValueError(
                f"every={self.every}, steps={self.steps}: checkpoint more than once a run "
                "(1 ≤ every < steps - 1), so a kill can fall after a checkpoint"
            )


def train_command(run_dir: Path, config: FaultsConfig, *extra: str) -> list[str]:
    """The `plait train` command of one run (the reference and every trial run it)."""
    return [
        sys.executable,
        "-m",
        "plait.cli.main",
        "train",
        "--run-dir",
        str(run_dir),
        "--pp",
        str(config.nproc),
        "--max-steps",
        str(config.steps),
        "--checkpoint-every",
        str(config.every),
        "--log-every",
        "1",
        *config.model.split(),
        *extra,
    ]


def workers_of(pid: int) -> list[int]:
    """The worker processes the launcher `pid` spawned (its children running
    multiprocessing's spawn entry point, not its resource tracker); Linux /proc only."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return rows


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The whole model of the run's newest checkpoint (the one saved after its last step)."""
    import torch

    from plait.checkpoint.inspect import export_model
    from plait.checkpoint.store import published

    newest = published(run_dir / "checkpoints")
    if not newest:
        raise RuntimeError(f"{run_dir} has no checkpoint")
    out = run_dir / "final.pt"
    export_model(newest[0], out)
    return dict(torch.load(out, weights_only=True))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Stderr:
    """A child's stderr read on a thread, each line with the time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append((time.time(), line.rstrip("\n")))


def run_trial(
    config: FaultsConfig, folder: Path, index: int, rng: random.Random, reference: dict[str, Any]
) -> dict[str, Any]:
    """One trial: train, kill a random worker after a random step, let it recover."""
    run_dir = folder / f"trial-{index:02d}"
    kill_after = rng.randrange(1, config.steps - 1)  # steps finished before the kill
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        train_command(run_dir, config, "--max-restarts", "1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    err = _Stderr(proc)
    deadline = time.time() + config.trial_timeout_s
    outcome: dict[str, Any] = {"trial": index, "kill_after_steps": kill_after}
    try:
        while len(_rows(run_dir)) < kill_after:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"trial {index}: the run ended before step {kill_after}")
            time.sleep(0.002)
        done = len(_rows(run_dir))
        victim = rng.choice(workers_of(proc.pid))
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=max(1.0, deadline - time.time()))
    except BaseException:
        proc.kill()
        raise
    err.thread.join(timeout=10)
    restarts = [(t, m) for t, line in err.lines if (m := _RESTART.search(line))]
    outcome.update(exit_code=code, steps_done_at_kill=done, restarted=bool(restarts))
    if not restarts or code != 0:
        outcome.update(
            recovered=False, bit_identical=False, stderr=[line for _, line in err.lines][-5:]
        )
        return outcome
    said_at, match = restarts[0]
    resumed = int(match.group(3))
    first = next(r for r in _rows(run_dir) if r["step"] == resumed)
    outcome.update(
        recovered=True,
        failed_rank=int(match.group(1)),
        cause=match.group(2),
        resumed_from=resumed,
        lost_steps=done - resumed,
        restart_said_s=said_at - killed_at,
        recovery_s=first["time"] - killed_at,
        bit_identical=_equal(final_weights(run_dir), reference),
    )
    return outcome


def run_bench(config: FaultsConfig, folder: Path | None = None) -> dict[str, Any]:
    rng = random.Random(config.seed)
    with tempfile.TemporaryDirectory(prefix="plait-faults-") as tmp:
        root = folder or Path(tmp)
        ref_dir = root / "reference"
        subprocess.run(
            train_command(ref_dir, config),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        reference = final_weights(ref_dir)
        trials = []
        for i in range(config.trials):
            trials.append(run_trial(config, root, i, rng, reference))
            t = trials[-1]
            print(
                f"trial {i + 1}/{config.trials}: killed after step {t['steps_done_at_kill']}, "
                + (
                    f"rank {t['failed_rank']} ({t['cause']}), resumed from step "
                    f"{t['resumed_from']}, recovered in {t['recovery_s']:.2f} s, "
                    f"bit-identical: {t['bit_identical']}"
                    if t["recovered"]
                    else f"NOT recovered (exit {t['exit_code']})"
                ),
                file=sys.stderr,
                flush=True,
            )
    recovered = [t for t in trials if t["recovered"]]
    times = [t["recovery_s"] for t in recovered]
    return {
        "config": asdict(config) | {"schedule": "1f1b"},
        "trials": config.trials,
        "recovered": len(recovered),
        "bit_identical": sum(bool(t["bit_identical"]) for t in trials),
        "median_recovery_s": statistics.median(times) if times else None,
        "max_recovery_s": max(times) if times else None,
        "lost_steps_median": statistics.median(t["lost_steps"] for t in recovered)
        if recovered
        else None,
        "per_trial": trials,
    }


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = FaultsConfig()
    a = parser.add_argument
    a("--trials", type=int, default=d.trials, help="runs, each with one worker killed")
    a("--nproc", type=int, default=d.nproc, help="workers (pipeline stages) per run")
    a("--steps", type=int, default=d.steps, help="training steps per run")
    a("--every", type=int, default=d.every, help="checkpoint every N steps")
    a("--seed", type=int, default=d.seed, help="seed of the kill steps and victims")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    config = FaultsConfig(
        trials=args.trials, nproc=args.nproc, steps=args.steps, every=args.every, seed=args.seed
    )
    result = run_bench(config)
    if args.json:
        common.print_json(result)
        return 0

    def show(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    common.print_table(
        f"faults: {config.trials} runs of {config.steps} steps on {config.nproc} workers, "
        f"checkpoint every {config.every}, one worker SIGKILLed per run",
        [
            "trials",
            "recovered",
            "bit-identical",
            "median recovery s",
            "max recovery s",
            "median lost steps",
        ],
        [
            [
                result["trials"],
                result["recovered"],
                result["bit_identical"],
                show(result["median_recovery_s"]),
                show(result["max_recovery_s"]),
                show(result["lost_steps_median"]),
            ]
        ],
    )
    return 0
