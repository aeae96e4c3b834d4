"""The training loop one worker runs: build its stages, step, log metrics, summarise."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.blocks import equal_split, stage_modules
from plait.checkpoint import CheckpointStore
from plait.config import ModelConfig, ParallelPlan, TrainConfig
from plait.data import stdlib_corpus
from plait.mesh import init_worker, restart_count
from plait.models import GPT, GPTConfig
from plait.models.gpt import generate
from plait.runtime import StepResult
from plait.train.checkpointing import resume, save
from plait.train.engine import Engine, StepReport, parallelize
from plait.train.optim import optimizer_factory, scheduler_factory
from plait.train.validate import Validation, due, summarise, validate

__all__ = ["config_from_dict", "train_worker"]


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        **{k: v for k, v in data.items() if k not in ("model", "parallel")},
        model=ModelConfig(**data["model"]),
        parallel=ParallelPlan(**data["parallel"]),
    )


def _gpt_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    m = cfg.model
    return GPTConfig(
        vocab_size=vocab_size,
        seq_len=m.seq_len,
        num_layers=m.layers,
        hidden=m.hidden,
        num_heads=m.heads,
        ffn_hidden=m.ffn_hidden,
        dropout=m.dropout,
    )


def train_worker(cfg_data: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """Train under `cfg_data` (a TrainConfig as dict). Global rank 0 writes the run folder
    and returns the summary; the other ranks return None. After a restart (or with
    `resume`) the run goes on from its newest good checkpoint."""
    cfg = config_from_dict(cfg_data)
    env, device = init_worker(timeout_s=cfg.timeout_s)
    corpus = stdlib_corpus()
    torch.manual_seed(cfg.seed)
    model = GPT(_gpt_config(cfg, corpus.vocab_size))
    cfg = _layout(cfg, model, corpus, Path(run_dir), env.rank)
    engine = parallelize(
        model,
        cfg.parallel,
        optimizer_factory(cfg),
        GPT.loss,
        device=device,
        grad_clip=cfg.grad_clip,
        timeout_s=cfg.timeout_s,
        scheduler_factory=scheduler_factory(cfg),
    )
    store, start = _checkpoints(cfg, engine, Path(run_dir))
    window = engine.schedule
    group = window.num_microbatches // max(1, window.updates_per_window)
    log = _Logger(Path(run_dir), cfg, group, start=start) if env.rank == 0 else None
    times: list[float] = []
    report: StepReport | None = None
    val: Validation | None = None
    for step in range(start, cfg.max_steps):
        batch = corpus.batch(step, cfg.batch_size, cfg.model.seq_len, seed=cfg.seed)
        t0 = time.perf_counter()
        report = engine.step(batch)
        times.append(time.perf_counter() - t0)
        if due(cfg, step + 1):
            val = validate(engine, corpus, cfg, step)
        if log is not None:
            log.step(step, report, times[-1], val if val is not None and val.step == step else None)
        if store is not None:
            _maybe_save(cfg, engine, store, step + 1, log)
    drained = engine.drain()  # an asynchronous pipeline's last backwards and updates
    if log is not None:
        log.updates(cfg.max_steps, drained)
    if store is not None:
        store.wait()
    if report is None:  # resumed at the last step: nothing left to run
        report = drained
    records = _gather(_records(report.result))
    memory = max(_gather(_peak_memory_bytes()))
    sample = _sample(engine, model, corpus, cfg, env.rank)
    if log is None:
        return None
    summary = log.finish(engine.schedule, times, records, sample, memory)
    summarise(Path(run_dir), summary, val)
    return summary


def _layout(cfg: TrainConfig, model: GPT, corpus: Any, run_dir: Path, rank: int) -> TrainConfig:
    """The layout to train under: as given, or planned on the workers (`plan="auto"`); a
    restarted run keeps the plan its first attempt chose (replanning could choose another
    layout, which loads the checkpoint but no longer computes bit for bit the same)."""
    if cfg.plan != "auto":
        return cfg
    chosen = run_dir / "plan.json"
    if restart_count() > 0 and chosen.is_file():
        from plait.train.autoplan import parallel_plan_from

        layout = parallel_plan_from(json.loads(chosen.read_text()))
        return dataclasses.replace(cfg, parallel=layout)
    return _planned(cfg, model, corpus, run_dir, rank)


def _checkpoints(
    cfg: TrainConfig, engine: Engine, run_dir: Path
) -> tuple[CheckpointStore | None, int]:
    """The run's checkpoint store (None when the run neither saves nor resumes) and the
    step to start at: that of the checkpoint resumed from, else 0."""
    target = cfg.resume or ("auto" if restart_count() > 0 else None)
    if cfg.checkpoint_every is None and target is None:
        return None, 0
    store = CheckpointStore(run_dir / "checkpoints", keep=cfg.keep)
    found = resume(engine, store, target) if target is not None else None
    return store, found.step if found is not None else 0


def _maybe_save(
    cfg: TrainConfig, engine: Engine, store: CheckpointStore, done: int, log: _Logger | None
) -> None:
    """Save after `done` steps when the cadence says so, and after the last step (a later
    run with more steps resumes there); otherwise publish a save that has finished."""
    every = cfg.checkpoint_every
    if every is None or (done % every and done < cfg.max_steps):
        store.poll()
        return
    info = {"plan": cfg.to_dict()["parallel"], "config": cfg.to_dict()}
    drained = save(engine, store, done, info)
    if drained is not None and log is not None:
        log.updates(done - 1, drained)


def _planned(cfg: TrainConfig, model: GPT, corpus: Any, run_dir: Path, rank: int) -> TrainConfig:
    """`cfg` under the plan the workers agree on (profiled and searched on rank 0)."""
    from plait.train.autoplan import auto_plan, parallel_plan_from

    largest = max(1, cfg.batch_size // dist.get_world_size())
    sizes = sorted({1, largest})
    samples = [corpus.batch(0, b, cfg.model.seq_len, seed=cfg.seed) for b in sizes]
    chosen = auto_plan(
        model,
        samples,
        GPT.loss,
        num_heads=cfg.model.heads,
        seq_len=cfg.model.seq_len,
        global_batch=cfg.batch_size,
        dtype=cfg.parallel.dtype,
        allow_staleness=cfg.allow_staleness,
    )
    if rank == 0:
        (run_dir / "plan.json").write_text(json.dumps(chosen, indent=2))
    return dataclasses.replace(cfg, parallel=parallel_plan_from(chosen), plan="auto")


def _records(result: StepResult) -> list[dict[str, Any]]:
    return [
        {
            "rank": r.rank,
            "index": r.index,
            "label": r.label,
            "start": r.start,
            "end": r.end,
            "wait": r.wait,
        }
        for r in result.records
    ]


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors of a (possibly tp- or FSDP-sharded) stage; a collective."""
    state = {}
    for name, t in module.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        state[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().cpu()
    return state


def _sample(engine: Engine, model: GPT, corpus: Any, cfg: TrainConfig, rank: int) -> str:
    """Gather the trained stages into one model on rank 0 and sample from it."""
    states = _gather({s: _full_state(m) for s, m in engine.stages.items()})
    if rank != 0 or cfg.sample_chars <= 0:
        return ""
    torch.manual_seed(cfg.seed)
    full = GPT(model.cfg)
    sizes = cfg.parallel.partition or equal_split(len(full.blocks()), cfg.parallel.num_stages)
    stages = stage_modules(full.blocks(), sizes)
    for per_rank in states:
        for s, state in per_rank.items():
            stages[s].load_state_dict(state)
    g = torch.Generator().manual_seed(cfg.seed)
    ids = generate(full, corpus.encode("def "), cfg.sample_chars, generator=g)
    return str(corpus.decode(ids))


def _peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class _Logger:
    """Metrics (one JSON line per step), progress on the terminal, and the run summary."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, group: int, *, start: int = 0) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.run_dir = run_dir
        self.cfg = cfg
        self.tokens = cfg.batch_size * cfg.model.seq_len
        # a resumed run keeps the lines of the steps before its checkpoint, and drops those
        # an interrupted attempt wrote after it
        self.metrics = _continued(run_dir / "metrics.jsonl", start)
        self.update_log = _continued(run_dir / "updates.jsonl", start)
        self.num_updates = 0
        self.pending: dict[int, list[float]] = {}  # update -> losses of its micro-batches
        self.group = group  # micro-batches per update
        self.window_losses: dict[int, list[float]] = {}  # step -> its micro-batches' losses
        self.skipped = 0
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.task = self.progress.add_task(
            "train", total=cfg.max_steps, completed=start, loss=float("nan"), tps=0.0
        )
        self.progress.start()

    def step(
        self, step: int, report: StepReport, seconds: float, val: Validation | None = None
    ) -> None:
        """A step's row. Its loss is that of the micro-batches the step reported: its own,
        or, for an asynchronous schedule, those of the step `loss_step` (earlier); None
        when none were reported yet."""
        loss = report.loss if math.isfinite(report.loss) else None
        self.skipped += report.skipped
        m = self.cfg.parallel.microbatches
        row = {
            "step": step,
            "loss": loss,
            "loss_step": report.microbatches[0] // m if report.microbatches else None,
            "step_time_s": seconds,
            "tokens_per_s": self.tokens / seconds,
            "skipped": report.skipped,
            "grad_norm": report.grad_norm,
            "time": time.time(),  # when the step ended: wall-clock gaps show stalls and restarts
        }
        row.update(val.row() if val is not None else {})
        self.metrics.write(json.dumps(row) + "\n")
        self.updates(step, report)
        for drained in val.drained if val is not None else []:
            self.updates(step, drained)
        if step % self.cfg.log_every == 0 or step == self.cfg.max_steps - 1:
            self.metrics.flush()
            self.update_log.flush()
        shown = loss if loss is not None else float("nan")
        self.progress.update(self.task, advance=1, loss=shown, tps=self.tokens / seconds)

    def updates(self, step: int, report: StepReport) -> None:
        """One line per optimizer update (an asynchronous schedule makes one per micro-batch,
        or one per batch), once the losses of all the micro-batches whose gradients it
        applies are in: their mean."""
        m = self.cfg.parallel.microbatches
        for x, loss in zip(report.microbatches, report.losses, strict=True):
            self.pending.setdefault(x // self.group, []).append(loss)
            self.window_losses.setdefault(x // m, []).append(loss)
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
    ) -> dict[str, Any]:
        self.progress.stop()
        self.metrics.close()
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
        }
        (self.run_dir / "timeline.json").write_text(json.dumps(records))
        (self.run_dir / "schedule.json").write_text(schedule.to_json())
        if self.cfg.plan != "auto":  # auto-planning wrote plan.json with its prediction
            (self.run_dir / "plan.json").write_text(json.dumps(self.cfg.to_dict()["parallel"]))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
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
    """Idle share of the last step: 1 - compute time / (ranks × step span)."""
    from plait.schedule import Action

    busy = span = 0.0
    for rank_records in records:
        for r in rank_records:
            if Action.parse(r["label"]).is_compute:
                busy += r["end"] - r["start"]
        if rank_records:
            span = max(span, max(r["end"] for r in rank_records))
    return 1.0 - busy / (span * len(records)) if span else 0.0
