"""What a training run reports as it goes: the `plait` logger's lines, metrics files and sinks.

`setup` configures the `plait` logger once per worker: on a terminal a rich handler and a
progress bar; otherwise (CI, a batch system, `| cat`) plain lines every `log_every` steps,
which a progress bar would hold back until the end. Workers other than rank 0 log warnings
only, unless asked, and leave torch's warnings, which every rank would repeat, to rank 0;
torch's advice on how DTensor redistributes a 2-D norm (a performance note about plait's
own mesh, one per rank and step) is not shown. `RunLogger` (rank 0) writes `metrics.jsonl`,
`updates.jsonl`, the optional TensorBoard and W&B scalars (`plait.train.sinks`) and, at the
end, the summary and the measured timelines.

Steps are numbered from 0 everywhere: `step` in metrics.jsonl and updates.jsonl, TensorBoard
and W&B, `--profile-steps A:B` (steps A to B-1) and the console's `step 0 (1/300)`; the
checkpoint `step-N` holds N steps done and a run resumed from it goes on at step N. Updates
are numbered from 0 too, and `loss_step` and `update` continue across resumes (a resumed
engine numbers its micro-batches from 0 again: `restarted` adds the step it began at).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plait.config import TrainConfig
from plait.config.sections import to_file
from plait.train.sinks import open_sinks

__all__ = ["LOGGER", "RecentSteps", "RunLogger", "describe_layout", "is_terminal", "setup"]

LOGGER = "plait"
_log = logging.getLogger(LOGGER)
_LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}


def is_terminal() -> bool:
    """Whether progress goes to a terminal (then a live bar, else plain lines)."""
    return sys.stdout.isatty()


def setup(verbosity: int = 0, rank: int = 0, all_ranks: bool = False) -> logging.Logger:
    """Configure the `plait` logger of this process (again: replaces the handler it set).
    verbosity -1 logs warnings only, 0 progress and notices, 1 debug details too; ranks
    other than 0 log warnings only unless `all_ranks`."""
    level = _LEVELS[max(-1, min(1, verbosity))]
    if rank != 0 and not all_ranks:
        level = logging.WARNING
    logger = logging.getLogger(LOGGER)
    for old in list(logger.handlers):
        logger.removeHandler(old)
    handler: logging.Handler
    if is_terminal():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(), show_path=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stdout)
        prefix = f"[rank {rank}] " if all_ranks else ""
        handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # one line per message, whatever the root logger does
    _quiet_torch(rank == 0 or all_ranks)
    return logger


class _DropRedistributeAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


# torch's logger of DTensor redistributions: under dp + tp the gradient norm over the 2-D
# mesh logs "2 sequential all_reduce operations will be performed" on every rank and step
_REDISTRIBUTE = "torch.distributed.tensor._redistribute"


def _quiet_torch(shows_warnings: bool) -> None:
    """Drop torch's repeated notes: the redistribution advice on every rank, and torch's
    Python warnings on ranks that leave them to rank 0 (each rank runs the same code)."""
    redistribute = logging.getLogger(_REDISTRIBUTE)
    if not any(isinstance(f, _DropRedistributeAdvice) for f in redistribute.filters):
        redistribute.addFilter(_DropRedistributeAdvice())
    if not shows_warnings:
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")


def describe_layout(plan: Mapping[str, Any]) -> str:
    """A layout in one line: the degrees, schedule, micro-batches, ZeRO, recomputation and
    dtype, then any other setting that is not its default (`chunks=2`, `compress=fp16`)."""
    from plait.config import ParallelPlan

    always = ("dp", "tp", "pp", "schedule", "microbatches", "zero", "recompute", "dtype")
    defaults = vars(ParallelPlan())
    parts = [f"{k}={plan[k]}" for k in always if k in plan]
    for key, value in plan.items():
        if key not in always and value is not None and value != defaults.get(key):
            shown = ",".join(map(str, value)) if isinstance(value, list | tuple) else value
            parts.append(f"{key}={shown}")
    return ", ".join(parts)


class RecentSteps:
    """The measured records of the last `keep` steps on this rank (every rank keeps its
    own; rank 0 gathers them for trace.json and timeline.png)."""

    def __init__(self, keep: int) -> None:
        self.steps: deque[dict[str, Any]] = deque(maxlen=max(1, keep))

    def add(self, step: int, result: Any) -> None:
        # the records themselves, turned into rows only at the end: a step costs an append
        self.steps.append({"step": step, "step_time": result.step_time, "records": result.records})

    def rows(self) -> list[dict[str, Any]]:
        return [
            {**entry, "records": [
                {"rank": r.rank, "index": r.index, "label": r.label, "start": r.start,
                 "end": r.end, "wait": r.wait}
                for r in entry["records"]
            ]}
            for entry in self.steps
        ]  # fmt: skip


class _Progress:
    """Progress on the terminal (a rich bar) or as plain lines every `log_every` steps."""

    def __init__(self, cfg: TrainConfig, start: int, tokens: int) -> None:
        self.cfg = cfg
        self.tokens = tokens
        self.window: list[float] = []  # step times since the last plain line
        self.bar: Any = None
        if is_terminal() and _log.isEnabledFor(logging.INFO):
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            consoles = [h.console for h in _log.handlers if hasattr(h, "console")]
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]:.3f}"),
                TextColumn("{task.fields[tps]:,.0f} tok/s"),
                TimeRemainingColumn(),
                transient=False,
                console=consoles[0] if consoles else None,
            )
            self.task = self.bar.add_task(
                "train", total=cfg.max_steps, completed=start, loss=float("nan"), tps=0.0
            )
            self.bar.start()

    def step(self, step: int, loss: float | None, seconds: float) -> None:
        shown = loss if loss is not None else float("nan")
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=shown, tps=self.tokens / seconds)
            return
        self.window.append(seconds)
        done, total = step + 1, self.cfg.max_steps
        if done == 1 or done % self.cfg.log_every == 0 or done == total:
            mean = statistics.fmean(self.window)
            self.window.clear()
            text = f"{loss:.3f}" if loss is not None else "-"
            _log.info(
                f"step {step} ({done}/{total}) | loss {text} | {self.tokens / mean:,.0f} tok/s | "
                f"{mean * 1e3:.1f} ms/step"
            )

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class RunLogger:
    """Metrics (one JSON line per step), progress, TensorBoard scalars and the summary."""

    def __init__(
        self,
        run_dir: Path,
        cfg: TrainConfig,
        group: int,
        *,
        start: int = 0,
        environment: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.environment = dict(environment or {})  # versions, commit, host, device
        self.cfg = cfg
        self.tokens = cfg.batch_size * cfg.model.seq_len
        # a resumed run keeps the lines of the steps before its checkpoint, and drops those
        # an interrupted attempt wrote after it
        self.metrics_file = _continued(run_dir / "metrics.jsonl", start)
        self.update_log = _continued(run_dir / "updates.jsonl", start)
        self.num_updates = 0
        self.pending: dict[int, list[float]] = {}  # update -> losses of its micro-batches
        self.group = group  # micro-batches per update
        self.base_step = start  # the step at which the engine's micro-batch ids began at 0
        self.window_losses: dict[int, list[float]] = {}  # step -> its micro-batches' losses
        self.skipped = 0
        self.sinks = open_sinks(tensorboard=cfg.tensorboard, wandb=cfg.wandb, run_dir=run_dir,
                                config=cfg.to_dict())  # fmt: skip
        self.progress = _Progress(cfg, start, self.tokens)

    def restarted(self, step: int) -> None:
        """The engine numbers its micro-batches from 0 again from step `step` on (a new
        engine: a resume, a re-partition; an asynchronous stream restarted after a save)."""
        self.base_step = step

    def step(
        self,
        step: int,
        report: Any,
        seconds: float,
        val: Any = None,
        *,
        lr: float | None = None,
        peak_memory_bytes: int | None = None,
    ) -> None:
        """A step's row. Its loss is that of the micro-batches the step reported: its own,
        or, for an asynchronous schedule, those of the step `loss_step` (earlier); None
        when none were reported yet. `lr` is the learning rate the step's update used,
        `peak_memory_bytes` this worker's peak so far (the device allocator's on CUDA, the
        process's maximum resident set on CPU). `val` (a `plait.train.validate.Validation` of
        this step) adds its fields to the row: one row per step, whatever is measured in it."""
        loss = report.loss if math.isfinite(report.loss) else None
        self.skipped += report.skipped
        m = self.cfg.parallel.microbatches
        first = report.microbatches[0] // m + self.base_step if report.microbatches else None
        row = {
            "step": step,
            "loss": loss,
            "loss_step": first,
            "lr": lr,
            "step_time_s": seconds,
            "tokens_per_s": self.tokens / seconds,
            "skipped": report.skipped,
            "grad_norm": report.grad_norm,
            "peak_memory_bytes": peak_memory_bytes,
            "time": time.time(),  # when the step ended: wall-clock gaps show stalls and restarts
        }
        extra = val.row() if val is not None else {}
        row.update(extra)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.updates(step, report)
        for drained in val.drained if val is not None else []:
            self.updates(step, drained)
        if step % self.cfg.log_every == 0 or step == self.cfg.max_steps - 1:
            self.metrics_file.flush()
            self.update_log.flush()
        names = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_memory_bytes")
        self._scalars(step, {**{k: row[k] for k in names}, **extra})
        self.progress.step(step, loss, seconds)
        if extra:
            self._say(step, {k: v for k, v in extra.items() if k != "val_samples"})

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Further metrics of `step` (`{"val_loss": 2.9}`, `{"lr": 3e-4}`): a row of
        metrics.jsonl, TensorBoard scalars and a log line."""
        row = {"step": step, **values, "time": time.time()}
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        self._scalars(step, values)
        self._say(step, values)

    def _say(self, step: int, values: Mapping[str, float]) -> None:
        shown = " | ".join(f"{k} {v:.4g}" for k, v in values.items())
        # not "step N/M ...": that line is the progress line's, which scripts count
        message = f"after step {step}: {shown}"
        if self.progress.bar is not None:
            self.progress.bar.console.print(message)
        else:
            _log.info(message)

    def _scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        given = {k: float(v) for k, v in values.items() if v is not None}
        for sink in self.sinks:
            sink.scalars(step, given)

    def updates(self, step: int, report: Any) -> None:
        """One line per optimizer update (an asynchronous schedule makes one per micro-batch,
        or one per batch), once the losses of all the micro-batches whose gradients it
        applies are in: their mean."""
        m = self.cfg.parallel.microbatches
        # updates before the engine's first micro-batch: base_step's steps of m / group each
        base = self.base_step * m // self.group
        for x, loss in zip(report.microbatches, report.losses, strict=True):
            self.pending.setdefault(base + x // self.group, []).append(loss)
            self.window_losses.setdefault(self.base_step + x // m, []).append(loss)
        for update in sorted(u for u, losses in self.pending.items() if len(losses) == self.group):
            losses = self.pending.pop(update)
            row = {"update": update, "step": step, "loss": sum(losses) / len(losses)}
            self.update_log.write(json.dumps(row) + "\n")
            self.num_updates += 1

    def finish(
        self,
        schedule: Any,
        times: list[float],
        records: list[list[dict[str, Any]]],
        sample: str,
        memory: int,
        recent: list[list[dict[str, Any]]] | None = None,
    ) -> dict[str, Any]:
        """Close the files, write the summary and timelines; `recent` holds each rank's
        `RecentSteps.rows()` (drawn into trace.json and timeline.png)."""
        self.progress.stop()
        self.metrics_file.close()
        self.update_log.close()
        steady = times[len(times) // 5 :] or times
        step_time = statistics.median(steady)
        summary = {
            "plan": {k: v for k, v in self.cfg.to_dict()["parallel"].items() if v is not None},
            "plan_source": self.cfg.plan or "as given",
            "schedule": schedule.to_dict(),
            "steps": len(times),
            "first_loss": statistics.mean(self.window_losses[min(self.window_losses)]),
            "final_loss": statistics.mean(
                loss for w in sorted(self.window_losses)[-10:] for loss in self.window_losses[w]
            ),
            "step_time_s": step_time,
            "tokens_per_s": self.tokens / step_time,
            "bubble_fraction": _measured_bubble(records),
            "peak_memory_bytes": memory,
            "skipped_steps": self.skipped,
            "updates": self.num_updates,
            "sample": sample,
            **self.environment,
        }
        (self.run_dir / "timeline.json").write_text(json.dumps(records))
        (self.run_dir / "schedule.json").write_text(schedule.to_json())
        if self.cfg.plan != "auto":  # auto-planning wrote plan.json with its prediction
            plan = to_file(self.cfg.to_dict()["parallel"])
            (self.run_dir / "plan.json").write_text(json.dumps(plan, indent=2))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        for sink in self.sinks:
            sink.close(summary)
        if recent:
            from plait.trace.run import write_run_timeline

            written = write_run_timeline(
                self.run_dir, recent, step_time_s=step_time, bubble=summary["bubble_fraction"]
            )
            _log.debug("timeline of the last steps: %s", ", ".join(str(p) for p in written))
        return summary


def _continued(path: Path, start: int) -> Any:
    """`path` opened for appending the lines of steps from `start` on: earlier lines kept,
    later ones (from an attempt that died after its last checkpoint) dropped."""
    kept = []
    if start > 0 and path.is_file():
        kept = [x for x in path.read_text().splitlines() if json.loads(x).get("step", 0) < start]
    out = path.open("w")
    out.writelines(line + "\n" for line in kept)
    return out


def _measured_bubble(records: list[list[dict[str, Any]]]) -> float:
    """Idle share of the ranks during the last step's pipelined compute, as the simulator
    defines it (`plait.sim.SimResult`): 1 - compute time / (ranks × the span from the
    first forward to the last backward). The optimizer step and reductions after the last
    backward are no bubble: a one-stage run has none."""
    from plait.schedule import Action

    busy = 0.0
    first, last = float("inf"), 0.0
    for rank_records in records:
        for r in rank_records:
            if Action.parse(r["label"]).is_compute:
                busy += r["end"] - r["start"]
                first, last = min(first, r["start"]), max(last, r["end"])
    span = last - first if last > first else 0.0
    return 1.0 - busy / (span * len(records)) if span else 0.0
