"""The training loop one worker runs: build its stages, step, log metrics, summarise."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from plait import heartbeat
from plait.checkpoint import Checkpoint, CheckpointStore
from plait.config import ParallelPlan, TrainConfig, config_from_dict
from plait.config.sections import flat_plan_file, to_file
from plait.device import deterministic, peak_memory_bytes, tf32
from plait.mesh import agreed_restart_count, init_worker
from plait.runtime import StepResult
from plait.train.checkpointing import resume, save
from plait.train.engine import Engine, StepReport
from plait.train.environment import run_environment
from plait.train.logs import LOGGER, RecentSteps, RunLogger, describe_layout, setup
from plait.train.optim import optimizer_factory, scheduler_factory
from plait.train.parallelize import parallelize
from plait.train.partition_state import (
    current_plan,
    find_checkpoint,
    resumed_layout,
    write_partition,
)
from plait.train.profiling import StepProfiler
from plait.train.repartition import repartitioner
from plait.train.slowdown import check_cluster, padded_step
from plait.train.task import CustomTask, Task, gathered_model, task_from_config
from plait.train.validate import Validation, due, summarise, validate

__all__ = ["train_worker"]


def train_worker(
    cfg_data: dict[str, Any], run_dir: str, custom: CustomTask | None = None
) -> dict[str, Any] | None:
    """Train under `cfg_data` (a TrainConfig as dict) the task it names, or `custom` (a
    user's model and data, `plait.train.run`). Global rank 0 writes the run folder
    and returns the summary; the other ranks return None. After a restart (or with
    `resume`) the run goes on from its newest good checkpoint."""
    cfg = config_from_dict(cfg_data)
    if cfg.deterministic:  # before any kernel runs (cuBLAS reads its workspace setting once)
        deterministic(True)
    env, device = init_worker(timeout_s=cfg.timeout_s, device=cfg.device)
    heartbeat.start_from_env(env.rank, env.world_size)  # names lost peers under torchrun
    tf32(cfg.tf32, device)
    setup(cfg.verbosity, env.rank, all_ranks=cfg.log_all_ranks)
    task = custom.task(cfg) if custom is not None else task_from_config(cfg)
    model = task.model()
    num_params = sum(p.numel() for p in model.parameters())
    restarts = agreed_restart_count(device)
    cfg = _layout(cfg, model, task, Path(run_dir), env.rank, device, restarts)

    def build(plan: ParallelPlan) -> Engine:
        return parallelize(model, plan, optimizer_factory(cfg), task.loss, device=device,
                           grad_clip=cfg.grad_clip, timeout_s=cfg.timeout_s,
                           scheduler_factory=scheduler_factory(cfg),
                           compile=cfg.compile)  # fmt: skip

    record = _model_record(model)  # checkpoints carry it: exports rebuild the model from it
    target = cfg.resume or ("auto" if restarts > 0 else None)
    found = find_checkpoint(target, Path(run_dir) / "checkpoints")
    engine = build(resumed_layout(cfg, found))  # a re-partitioned run's split is kept
    moving = repartitioner(cfg, model, build)
    store, start = _checkpoints(cfg, engine, Path(run_dir), found, target)
    if env.rank == 0:  # before the first step: a long run shows what it runs under at once
        how = "planned on the workers" if cfg.plan == "auto" else cfg.plan or "as given"
        at = f"; resuming at step {start}" if start else ""
        logging.getLogger(LOGGER).info(
            f"layout ({how}): {describe_layout(cfg.to_dict()['parallel'])}{at}"
        )
    window = engine.schedule
    group = window.num_microbatches // max(1, window.updates_per_window)
    log = None
    if env.rank == 0:
        running = dataclasses.replace(cfg, parallel=_running(cfg, engine))
        log = RunLogger(Path(run_dir), running, group, start=start,
                        environment=run_environment(device))  # fmt: skip
    if store is not None and cfg.checkpoint_start and start == 0:
        _save(cfg, engine, store, 0, log, record)  # the initial weights, before any update
    recent = RecentSteps(cfg.trace_steps)  # every rank: rank 0 draws them at the end
    profiler = StepProfiler(cfg.profile_steps, Path(run_dir), env.rank, device)
    times: list[float] = []
    slowdown = check_cluster(cfg.cluster, env.world_size)[env.rank] if cfg.cluster else 1.0
    report: StepReport | None = None
    val: Validation | None = None
    for step in range(start, cfg.max_steps):
        batch = task.batch(step)
        profiler.tick(step)
        lr = _learning_rate(engine)  # the one this step's update uses
        t0 = time.perf_counter()
        report = padded_step(engine, batch, slowdown, index=step)  # padded: --cluster
        times.append(time.perf_counter() - t0)
        if moving is not None:  # between steps: the next one may run on another partition
            before, engine = engine, moving.after_step(engine, report, step)
            if log is not None and engine is not before:
                log.restarted(step + 1)
                log.cfg = dataclasses.replace(log.cfg, parallel=_running(cfg, engine))
                write_partition(Path(run_dir), cfg, engine.plan)
        recent.add(step, report.result)
        if due(cfg, step + 1):
            val = validate(engine, task, cfg, step, whole=step + 1 == cfg.max_steps)
        if store is not None:  # the save started a step ago is published before this
            store.settle()  # step's row: a kill once the row is out loses only this step
        if log is not None:
            log.step(step, report, times[-1], val if val is not None and val.step == step else None,
                     lr=lr, peak_memory_bytes=peak_memory_bytes(device))  # fmt: skip
        if cfg.flush_every and (step + 1) % cfg.flush_every == 0 and step + 1 < cfg.max_steps:
            _flush(engine, step + 1, log)
        if store is not None:
            _maybe_save(cfg, engine, store, step + 1, log, record)
    drained = engine.drain()  # an asynchronous pipeline's last backwards and updates
    profiler.close()
    if log is not None:
        log.updates(cfg.max_steps, drained)
    if store is not None:
        store.wait()
    if report is None:  # resumed at the last step: nothing left to run
        report = drained
    records = _gather(_records(report.result))
    traced = _gather(recent.rows())
    memory = max(_gather(peak_memory_bytes(device)))
    sample = _sample(engine, task, env.rank, num_params)
    if log is None:
        return None
    summary = log.finish(engine.schedule, times, records, sample, memory, traced)
    summarise(Path(run_dir), summary, val)
    return summary


def _layout(
    cfg: TrainConfig,
    model: nn.Module,
    task: Task,
    run_dir: Path,
    rank: int,
    device: Any,
    restarts: int,
) -> TrainConfig:
    """The layout to train under: as given, or planned on the workers (`plan="auto"`); a
    restarted run keeps the plan its first attempt chose (replanning could choose another
    layout, which loads the checkpoint but no longer computes bit for bit the same)."""
    if cfg.plan != "auto":
        return cfg
    chosen = run_dir / "plan.json"
    if restarts > 0 and chosen.is_file():
        from plait.train.autoplan import parallel_plan_from

        layout = parallel_plan_from(flat_plan_file(json.loads(chosen.read_text()), str(chosen)))
        return dataclasses.replace(cfg, parallel=layout)
    return _planned(cfg, model, task, run_dir, rank, device)


def _checkpoints(
    cfg: TrainConfig, engine: Engine, run_dir: Path, found: Checkpoint | None, target: str | None
) -> tuple[CheckpointStore | None, int]:
    """The run's checkpoint store (None when the run neither saves nor resumes) and the
    step to start at: that of `found`, the checkpoint resumed from (`target` named it),
    else 0."""
    if cfg.checkpoint_every is None and not cfg.checkpoint_start and target is None:
        return None, 0
    store = CheckpointStore(run_dir / "checkpoints", keep=cfg.keep or None)  # 0: all
    if found is not None:
        resume(engine, store, found)
    return store, found.step if found is not None else 0


def _flush(engine: Engine, done: int, log: RunLogger | None) -> None:
    """Finish an asynchronous stream's micro-batches in flight after `done` steps and start
    a new one (`flush_every`): where the run's checkpoints are saved, whether it saves or
    not, so saving does not change what it trains."""
    if engine.synchronous:
        return
    drained = engine.drain()
    engine.restart()
    if log is not None:
        log.updates(done - 1, drained)
        log.restarted(done)


def _maybe_save(
    cfg: TrainConfig,
    engine: Engine,
    store: CheckpointStore,
    done: int,
    log: RunLogger | None,
    record: dict[str, Any] | None = None,
) -> None:
    """Save after `done` steps when the cadence says so, and after the last step (a later
    run with more steps resumes there); otherwise publish a save that has finished."""
    every = cfg.checkpoint_every
    if every is None or (done % every and done < cfg.max_steps):
        store.poll()
        return
    _save(cfg, engine, store, done, log, record)


def _save(
    cfg: TrainConfig,
    engine: Engine,
    store: CheckpointStore,
    done: int,
    log: RunLogger | None,
    record: dict[str, Any] | None,
) -> None:
    """Start saving the checkpoint of `done` steps."""
    if done == cfg.max_steps and hasattr(engine, "finish"):
        engine.finish()  # WSP: the last save holds the global weights, every wave taken in
    # the plan the engine runs (a re-partitioned split), and the run's own config
    info = {"plan": current_plan(cfg, engine.plan), "config": cfg.to_dict(), "model": record}
    drained = save(engine, store, done, info)
    if drained is not None and log is not None and done > 0:
        log.updates(done - 1, drained)
        log.restarted(done)  # the stream restarted: its micro-batch ids begin at 0 again


def _planned(
    cfg: TrainConfig, model: nn.Module, task: Task, run_dir: Path, rank: int, device: Any
) -> TrainConfig:
    """`cfg` under the plan the workers agree on (profiled on rank 0's `device` and
    searched there)."""
    from plait.train.autoplan import parallel_plan_from

    chosen = _decided(cfg, model, task, device)
    if rank == 0:
        (run_dir / "plan.json").write_text(json.dumps(to_file(chosen), indent=2))
    return dataclasses.replace(cfg, parallel=parallel_plan_from(chosen), plan="auto")


def _decided(cfg: TrainConfig, model: nn.Module, task: Task, device: Any) -> dict[str, Any]:
    """The plan `--plan auto` decides for `cfg` (a collective), or the one it kept for
    the same flags on this host (`plait.train.decisions`)."""
    from plait.device import device_name
    from plait.train.autoplan import auto_plan, declared_cluster, plan_samples
    from plait.train.decisions import decision_key

    world = dist.get_world_size()
    key = decision_key(cfg.to_dict(), world, device_name(device))
    return auto_plan(
        model,
        plan_samples(task, cfg.batch_size, dist.get_world_size()),
        task.loss,
        num_heads=task.num_heads,
        seq_len=task.seq_len,
        global_batch=cfg.batch_size,
        dtype=cfg.parallel.dtype,
        allow_staleness=cfg.allow_staleness,
        device=device,
        key=key,
        replan=cfg.replan,
        declared=declared_cluster(cfg, world),
    )


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


#: Parameters above which no text is sampled after training, by device: gathering the
#: whole model onto one worker and generating with it would take longer than it is worth
SAMPLE_MAX_PARAMS = {"cpu": 10**8, "cuda": 10**9}


def _sample(engine: Engine, task: Task, rank: int, num_params: int) -> str:
    """A text sample of the trained model, generated on rank 0's device from the stages
    gathered there (a collective); a note instead when the model is too large for it."""
    if task.sample is None:
        return ""
    limit = SAMPLE_MAX_PARAMS.get(engine.device.type, SAMPLE_MAX_PARAMS["cpu"])
    if num_params > limit:
        return (
            f"(no sample: the model's {num_params / 1e6:,.0f}M parameters exceed the "
            f"{limit / 1e6:,.0f}M above which plait skips sampling on {engine.device.type})"
        )
    full = gathered_model(engine, task, engine.plan.partition, rank, device=engine.device)
    return task.sample(full) if full is not None else ""


def _model_record(model: nn.Module) -> dict[str, Any] | None:
    from plait.models.record import model_record

    return model_record(model)


def _learning_rate(engine: Engine) -> float | None:
    """The learning rate of this rank's first stage (every stage follows one schedule)."""
    for stage in sorted(engine.optimizers):
        groups = engine.optimizers[stage].param_groups
        return float(groups[0]["lr"]) if groups else None
    return None


def _running(cfg: TrainConfig, engine: Engine) -> ParallelPlan:
    """The run's layout on the partition the engine runs (a re-partitioned one); a
    heterogeneous or WSP run's engine holds one pipeline's plan: the run's layout stands."""
    par = cfg.parallel
    if par.pipelines is not None or par.wsp_staleness is not None:
        return par
    return dataclasses.replace(par, partition=engine.plan.partition)
