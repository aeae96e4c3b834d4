"""The training loop one worker runs: build its stages, step, log metrics, summarise."""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.config import ModelConfig, PipelineConfig, TrainConfig
from plait.data import stdlib_corpus
from plait.mesh import init_worker
from plait.models import GPT, GPTConfig
from plait.models.gpt import generate
from plait.runtime import PipelineExecutor, StepResult, local_stages, split_microbatches
from plait.schedule import build

__all__ = ["config_from_dict", "train_worker"]


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        **{k: v for k, v in data.items() if k not in ("model", "pipeline")},
        model=ModelConfig(**data["model"]),
        pipeline=PipelineConfig(**data["pipeline"]),
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
    """Train under `cfg_data` (a TrainConfig as dict); the last stage's rank writes the run
    folder and returns the summary, other ranks return None."""
    cfg = config_from_dict(cfg_data)
    env, device = init_worker()
    p = cfg.pipeline
    schedule = build(p.schedule, p.pp, p.microbatches, p.chunks)
    corpus = stdlib_corpus()
    torch.manual_seed(cfg.seed)
    model = GPT(_gpt_config(cfg, corpus.vocab_size))
    stages = local_stages(model, schedule, env.rank, device=device)
    executor = PipelineExecutor(schedule, stages, rank=env.rank, loss_fn=GPT.loss, device=device)
    params = [q for s in stages.values() for q in s.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    is_first, is_last = 0 in stages, schedule.num_stages - 1 in stages
    log = _Logger(Path(run_dir), cfg) if is_last else None
    times: list[float] = []
    result: StepResult | None = None
    for step in range(cfg.max_steps):
        x, y = corpus.batch(step, cfg.batch_size, cfg.model.seq_len, seed=cfg.seed)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        result = executor.step(
            split_microbatches(x.to(device), p.microbatches) if is_first else None,
            split_microbatches(y.to(device), p.microbatches) if is_last else None,
        )
        opt.step()
        times.append(time.perf_counter() - t0)
        if log is not None and result.loss is not None:
            log.step(step, float(result.loss), times[-1])
    assert result is not None
    records = _gather_records(result, env.rank, env.world_size)
    sample = _sample(model, stages, corpus, cfg, env.rank, env.world_size)
    if log is None:
        return None
    return log.finish(schedule, times, records, sample)


def _gather_records(result: StepResult, rank: int, world: int) -> list[list[dict[str, Any]]]:
    mine = [
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
    out: list[Any] = [None] * world
    dist.all_gather_object(out, mine)
    return out


def _sample(
    model: GPT, stages: dict[int, Any], corpus: Any, cfg: TrainConfig, rank: int, world: int
) -> str:
    """Gather every rank's trained blocks into one model and sample from it (small models)."""
    states: list[Any] = [None] * world
    mine = {s: {k: v.detach().cpu() for k, v in m.state_dict().items()} for s, m in stages.items()}
    dist.all_gather_object(states, mine)
    if cfg.sample_chars <= 0:
        return ""
    from plait.blocks import equal_split, stage_modules

    blocks = model.blocks()
    full = stage_modules(blocks, equal_split(len(blocks), cfg.pipeline.pp * cfg.pipeline.chunks))
    for per_rank in states:
        for s, state in per_rank.items():
            full[s].load_state_dict(state)
    prompt = corpus.encode("def ")
    g = torch.Generator().manual_seed(cfg.seed)
    ids = generate(model.cpu(), prompt, cfg.sample_chars, generator=g)
    return str(corpus.decode(ids))


def _peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class _Logger:
    """Metrics (one JSON line per step), progress on the terminal, and the run summary."""

    def __init__(self, run_dir: Path, cfg: TrainConfig) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.run_dir = run_dir
        self.cfg = cfg
        self.tokens = cfg.batch_size * cfg.model.seq_len
        self.metrics = (run_dir / "metrics.jsonl").open("w")
        self.losses: list[float] = []
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=cfg.max_steps, loss=float("nan"), tps=0.0)
        self.progress.start()

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.losses.append(loss)
        row = {
            "step": step,
            "loss": loss,
            "step_time_s": seconds,
            "tokens_per_s": self.tokens / seconds,
        }
        self.metrics.write(json.dumps(row) + "\n")
        if step % self.cfg.log_every == 0 or step == self.cfg.max_steps - 1:
            self.metrics.flush()
        self.progress.update(self.task, advance=1, loss=loss, tps=self.tokens / seconds)

    def finish(
        self, schedule: Any, times: list[float], records: list[list[dict[str, Any]]], sample: str
    ) -> dict[str, Any]:
        self.progress.stop()
        self.metrics.close()
        steady = times[len(times) // 5 :] or times
        step_time = statistics.median(steady)
        summary = {
            "plan": {
                "pp": schedule.num_ranks,
                "schedule": schedule.kind,
                "microbatches": schedule.num_microbatches,
                "chunks": schedule.num_chunks,
            },
            "steps": len(times),
            "first_loss": self.losses[0],
            "final_loss": statistics.mean(self.losses[-10:]),
            "step_time_s": step_time,
            "tokens_per_s": self.tokens / step_time,
            "bubble_fraction": _measured_bubble(records),
            "peak_memory_bytes": _peak_memory_bytes(),
            "sample": sample,
        }
        (self.run_dir / "timeline.json").write_text(json.dumps(records))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _measured_bubble(records: list[list[dict[str, Any]]]) -> float:
    """Idle share of the last step: 1 - compute time / (ranks × step span)."""
    compute = ("F", "B", "BI", "BW")
    busy = span = 0.0
    for rank_records in records:
        for r in rank_records:
            op = r["label"].strip("0123456789v")
            if op in compute:
                busy += r["end"] - r["start"]
        if rank_records:
            span = max(span, max(r["end"] for r in rank_records))
    return 1.0 - busy / (span * len(records)) if span else 0.0
