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
from plait.bench._fault_modes import HETERO_PLAN, MODES, SLOW_CLUSTER

__all__ = ["MODES", "FaultsConfig", "run_bench", "train_command", "workers_of"]

# a mode: its workers and the layout flags of its runs (PLAN: the heterogeneous plan file)


def parse_modes(text: str) -> tuple[str, ...]:
    """`--modes`: "all" or names of `MODES`, comma-separated."""
    names = tuple(MODES) if text.strip() == "all" else tuple(m.strip() for m in text.split(","))
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise ValueError(f"modes={text!r}: unknown {unknown}; choose 'all' or of {list(MODES)}")
    return names


_RESTART = re.compile(r"rank (\d+) failed \((.+)\); restart 1 of \d+, resuming from step (\d+)")


@dataclass(frozen=True)
class FaultsConfig:
    trials: int = 20  # per mode
    nproc: int = 2  # pipeline stages (local workers) of the 1f1b mode
    steps: int = 24
    every: int = 4  # checkpoint cadence
    seed: int = 0
    model: str = "--layers 2 --hidden 64 --seq-len 32 --batch-size 16 --sample-chars 1"
    trial_timeout_s: float = 300.0
    modes: tuple[str, ...] = ("1f1b",)

    def __post_init__(self) -> None:
        if self.trials < 1 or self.nproc < 2:
            raise ValueError(
                f"trials={self.trials}, nproc={self.nproc}: give ≥ 1 trial, ≥ 2 workers"
            )
        parse_modes(",".join(self.modes))
        if not self.trial_timeout_s > 0:
            raise ValueError(f"trial_timeout_s={self.trial_timeout_s}: give seconds > 0")
        if not 1 <= self.every < self.steps - 1:
            raise ValueError(
                f"every={self.every}, steps={self.steps}: checkpoint more than once a run "
                "(1 ≤ every < steps - 1), so a kill can fall after a checkpoint"
            )


def train_command(
    run_dir: Path, config: FaultsConfig, *extra: str, mode: str = "1f1b"
) -> list[str]:
    """The `plait train` command of one run of `mode` (the reference and every trial run
    it); a mode's files (a plan, a cluster) are written beside `run_dir`."""
    workers, flags = MODES[mode]
    if mode == "1f1b":
        workers, flags = config.nproc, ("--pp", str(config.nproc))
    layout = []
    for flag in flags:
        if flag == "PLAN":
            flag = _write(run_dir.parent / "hetero-plan.json", json.dumps(HETERO_PLAN))
        elif flag == "SLOW":
            flag = _write(run_dir.parent / "one-slow.toml", SLOW_CLUSTER)
        layout.append(str(config.every) if flag == "EVERY" else flag)
    return [
        sys.executable, "-m", "plait.cli.main", "train", "--run-dir", str(run_dir),
        "--nproc", str(workers), *layout, "--max-steps", str(config.steps),
        "--checkpoint-every", str(config.every), "--log-every", "1", *config.model.split(),
        *extra,
    ]  # fmt: skip


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


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
    config: FaultsConfig,
    folder: Path,
    index: int,
    rng: random.Random,
    reference: dict[str, Any],
    mode: str = "1f1b",
) -> dict[str, Any]:
    """One trial: train, kill a random worker after a random step, let it recover."""
    run_dir = folder / f"trial-{index:02d}"
    kill_after = rng.randrange(1, config.steps - 1)  # steps finished before the kill
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        train_command(run_dir, config, "--max-restarts", "1", mode=mode),
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
                return _unfinished(outcome, proc, err, f"the run ended before step {kill_after}")
            time.sleep(0.002)
        done = len(_rows(run_dir))
        victim = rng.choice(workers_of(proc.pid))
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        return _unfinished(outcome, proc, err, f"no end within {config.trial_timeout_s:g} s")
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


def _unfinished(
    outcome: dict[str, Any], proc: subprocess.Popen[str], err: _Stderr, why: str
) -> dict[str, Any]:
    """A trial that did not end in time, or ended early: counted as not recovered (the
    bench goes on to the next trial), with why and the run's last lines."""
    proc.kill()
    proc.wait()
    err.thread.join(timeout=10)
    outcome.update(recovered=False, bit_identical=False, unfinished=why,
                   stderr=[line for _, line in err.lines][-5:])  # fmt: skip
    return outcome


def _summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    recovered = [t for t in trials if t["recovered"]]
    times = [t["recovery_s"] for t in recovered]
    lost = [t["lost_steps"] for t in recovered]
    return {
        "trials": len(trials),
        "recovered": len(recovered),
        "bit_identical": sum(bool(t["bit_identical"]) for t in trials),
        "median_recovery_s": statistics.median(times) if times else None,
        "max_recovery_s": max(times) if times else None,
        "lost_steps_median": statistics.median(lost) if lost else None,
    }


def _run_mode(config: FaultsConfig, root: Path, mode: str) -> list[dict[str, Any]]:
    """The uninterrupted reference run of `mode`, then its trials."""
    rng = random.Random(f"{config.seed}:{mode}")
    ref_dir = root / "reference"
    done = subprocess.run(
        train_command(ref_dir, config, mode=mode), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"mode {mode}: the uninterrupted run failed: {last}")
    reference = final_weights(ref_dir)
    trials = []
    for i in range(config.trials):
        trials.append(run_trial(config, root, i, rng, reference, mode))
        t = trials[-1]
        print(
            f"{mode} trial {i + 1}/{config.trials}: killed after step "
            f"{t['steps_done_at_kill']}, "
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
    return trials


def _kept(out: Path | None, config: FaultsConfig, mode: str) -> dict[str, Any] | None:
    """A mode's results that an earlier run with the same settings left in `out`."""
    if out is None or not (out / f"{mode}.json").is_file():
        return None
    kept = json.loads((out / f"{mode}.json").read_text())
    return kept if kept.get("config") == _settings(config) else None


def _settings(config: FaultsConfig) -> dict[str, Any]:
    """What a mode's trials depend on: every setting but the list of modes."""
    return {k: v for k, v in asdict(config).items() if k != "modes"}


def run_bench(
    config: FaultsConfig, folder: Path | None = None, out: Path | None = None
) -> dict[str, Any]:
    """Every mode's trials; the totals over all modes at the top, each mode's in `modes`
    (with the 1f1b mode alone, the same numbers). With `out`, each mode's trials are
    written there as the mode ends (`<mode>.json`), and a mode already there under the
    same settings is taken from it rather than run again: a run of every mode (hours on
    a small host) can stop and go on."""
    per_mode: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}  # modes whose uninterrupted run failed: why
    with tempfile.TemporaryDirectory(prefix="plait-faults-") as tmp:
        root = folder or Path(tmp)
        for mode in config.modes:
            kept = _kept(out, config, mode)
            if kept is not None:
                print(f"{mode}: {len(kept['trials'])} trials kept in {out}", file=sys.stderr)
                per_mode[mode] = kept["trials"]
                if "error" in kept:
                    failed[mode] = kept["error"]
                continue
            try:
                per_mode[mode] = _run_mode(config, root / mode, mode)
            except RuntimeError as error:  # the other modes still say what they can
                print(f"{mode}: {error}", file=sys.stderr, flush=True)
                per_mode[mode], failed[mode] = [], str(error)
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                record = {"config": _settings(config), "trials": per_mode[mode]}
                _write(
                    out / f"{mode}.json",
                    json.dumps(
                        record | ({"error": failed[mode]} if mode in failed else {}), indent=1
                    ),
                )
    trials = [t | {"mode": m} for m, ts in per_mode.items() for t in ts]
    modes = {m: _summary(ts) | ({"error": failed[m]} if m in failed else {})
             for m, ts in per_mode.items()}  # fmt: skip
    return {
        "config": asdict(config) | {"schedule": "1f1b"},
        **_summary(trials),
        "modes": modes,
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
    a("--modes", default=",".join(d.modes),
      help=f"'all' or modes to kill runs of, comma-separated: {', '.join(MODES)}")  # fmt: skip
    a("--out", type=Path, help="keep each mode's trials in this folder as the mode ends; "
      "modes already there under the same settings are not run again")  # fmt: skip
    a("--trial-timeout", type=float, default=d.trial_timeout_s, metavar="S",
      help="seconds a trial may take before it counts as not recovered")  # fmt: skip
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    config = FaultsConfig(
        trials=args.trials, nproc=args.nproc, steps=args.steps, every=args.every,
        seed=args.seed, modes=parse_modes(args.modes), trial_timeout_s=args.trial_timeout,
    )  # fmt: skip
    result = run_bench(config, out=args.out)
    if args.json:
        common.print_json(result)
        return 0

    def show(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    common.print_table(
        f"faults: {config.trials} runs per mode of {config.steps} steps, checkpoint every "
        f"{config.every}, one worker SIGKILLed per run",
        ["mode", "trials", "recovered", "bit-identical", "median recovery s",
         "max recovery s", "median lost steps"],
        [
            [mode, r["trials"], r["recovered"], r["bit_identical"],
             show(r["median_recovery_s"]), show(r["max_recovery_s"]),
             show(r["lost_steps_median"])]
            for mode, r in result["modes"].items()
        ],
    )  # fmt: skip
    return 0
