"""Checkpoints of heterogeneous pipelines and of Wave Synchronous Parallel, on 4 gloo
workers (a 1-rank and a 3-rank pipeline): a run that saves equals the run that does not,
and a run resumed from its step-4 checkpoint ends on the same weights, bit for bit, with
updates of waves still in flight at the save (WSP, D = 1). A synchronous plan's
checkpoint holds the model (pipeline 0's weights), which a plain data-parallel layout
loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.checkpoint import CheckpointStore
from plait.config import ParallelPlan
from plait.train.checkpointing import resume, save
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_hetpipe import PIPELINES, _batch, _model, _sgd

pytestmark = pytest.mark.dist

SYNC = ParallelPlan(dp=2, pp=2, pipelines=PIPELINES)
WSP = dataclasses.replace(SYNC, wsp_staleness=1, wsp_wave=2)
STEPS, SAVED = 6, 4


def _weights(engine: object) -> dict[str, torch.Tensor]:
    return {f"{s}.{n}": p.detach().clone()
            for s, stage in engine.stages.items()  # type: ignore[attr-defined]
            for n, p in stage.named_parameters()}  # fmt: skip


def _run(plan: ParallelPlan, root: Path | None, start: int = 0) -> dict[str, torch.Tensor]:
    """Train to STEPS, saving every 2 steps into `root` (None: no saves), or resume from
    the checkpoint of step `start` in `root`; the weights after the last step."""
    engine = parallelize(_model(), plan, _sgd, _model().loss, device="cpu", grad_clip=0.5)
    store = CheckpointStore(root) if root is not None else None
    if start:
        found = resume(engine, store, str(root / f"step-{start:08d}"))  # type: ignore[arg-type, operator]
        assert found is not None and found.step == start
    for step in range(start, STEPS):
        engine.step(_batch(step), index=step)
        if store is not None and not start and (step + 1) % 2 == 0:
            save(engine, store, step + 1, {"plan": {}})
    if store is not None:
        store.wait()
    engine.finish()  # WSP: every wave taken in
    return _weights(engine)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{where}: {name} differs on rank {dist.get_rank()}"


def _exact(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    for name, plan in (("sync", SYNC), ("wsp", WSP)):
        root = Path(tmp) / name
        plain = _run(plan, None)
        _same(plain, _run(plan, root), f"{name}: saving")
        _same(plain, _run(plan, root, start=SAVED), f"{name}: resumed at step {SAVED}")
    # the synchronous checkpoint is the model itself: a plain layout loads it
    model = _model()
    flat = parallelize(model, ParallelPlan(dp=4, pp=1), _sgd, model.loss, device="cpu")
    assert resume(flat, CheckpointStore(Path(tmp) / "sync"), "auto") is not None
    hetero = parallelize(_model(), SYNC, _sgd, _model().loss, device="cpu")
    resume(hetero, CheckpointStore(Path(tmp) / "sync"), "auto")
    theirs = {n: p for stage in flat.stages.values() for n, p in stage.named_parameters()}
    for stage in hetero.stages.values():
        for j, block in enumerate(stage.blocks):
            for n, p in block.named_parameters():
                q = theirs[f"blocks.{stage.first_block + j}.{n}"]
                # pipeline 0's are the model's; another pipeline's differ in the last bits
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    dist.barrier()


def test_heterogeneous_and_wsp_runs_resume_bit_identical(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _exact, str(tmp_path))


def test_plait_train_resumes_a_heterogeneous_plan_bit_identical(tmp_path: Path) -> None:
    """As a user runs it: a plan file of a 1-rank and a 2-rank pipeline, stopped after
    step 4 and resumed, logs the losses and ends on the weights of the run never stopped
    (whose text sample, gathered from pipeline 0, is written too)."""
    import json

    from plait.bench.faults import final_weights
    from plait.cli.main import main

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "dp": 2, "pp": 2, "tp": 1, "schedule": "1f1b", "microbatches": 2,
        "pipelines": [{"partition": [4], "microbatches": 2},
                      {"partition": [2, 2], "microbatches": 2}],
    }))  # fmt: skip
    flags = ["--nproc", "3", "--plan", str(plan), "--layers", "2", "--hidden", "16", "--heads",
             "2", "--seq-len", "16", "--batch-size", "8", "--eval-batches", "0", "-q"]  # fmt: skip
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert main(["train", "--run-dir", str(whole), "--max-steps", "6", "--checkpoint-every",
                 "6", "--sample-chars", "8", *flags]) == 0  # fmt: skip
    assert json.loads((whole / "summary.json").read_text())["sample"]
    base = ["train", "--run-dir", str(stopped), "--checkpoint-every", "2", "--sample-chars", "0"]
    assert main([*base, *flags, "--max-steps", "4"]) == 0
    assert main([*base, *flags, "--max-steps", "6", "--resume", "auto"]) == 0

    def losses(run_dir: Path) -> list[float]:
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows]

    assert losses(stopped) == losses(whole)
    a, b = final_weights(whole), final_weights(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
