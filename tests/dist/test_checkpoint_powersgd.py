"""PowerSGD's state (error feedback, warm-start factors, step count, generator) is saved
per rank: a run checkpointed after PowerSGD has started and resumed equals the run that
went on, bit for bit; without that state it would not; a checkpoint that lacks it (saved
before it was checkpointed) still loads, and PowerSGD starts afresh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

import plait.checkpoint.state as checkpoint_state
from plait.checkpoint import CheckpointStore
from plait.parallel.compress import hook_for
from plait.train.checkpointing import resume, save

from .harness import run_world
from .test_checkpoint import _batch, _engine, _train, _weights

pytestmark = pytest.mark.dist

PLAN = {"dp": 2, "pp": 1, "microbatches": 2, "compress": "powersgd:2"}
SAVED_AT, STEPS = 4, 6  # PowerSGD all-reduces plainly for 2 steps, then compresses


def _powersgd(engine: object) -> PowerSGDState:
    state = engine.grad_sync.hook_state  # type: ignore[attr-defined]
    assert isinstance(state, PowerSGDState)
    return state


def _same_weights(a: dict[int, list[torch.Tensor]], b: dict[int, list[torch.Tensor]]) -> bool:
    return all(torch.equal(p, q) for i in a for p, q in zip(a[i], b[i], strict=True))


def _resume(root: Path) -> object:
    engine = _engine(**PLAN)
    assert resume(engine, CheckpointStore(root), "auto") is not None
    return engine


def _powersgd_resume(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    root = Path(tmp) / "powersgd"
    store = CheckpointStore(root)
    straight = _engine(**PLAN)
    for step in range(STEPS):
        straight.step(_batch(step))
        if step + 1 == SAVED_AT:
            saved = _powersgd(straight)
            assert saved.iter == SAVED_AT and saved.p_memory_dict and saved.error_dict
            save(straight, store, SAVED_AT, {"plan": PLAN})
    store.wait()
    expected = _weights(straight)

    resumed = _resume(root)
    assert _powersgd(resumed).iter == SAVED_AT
    _train(resumed, SAVED_AT, STEPS)  # type: ignore[arg-type]
    assert _same_weights(_weights(resumed), expected), "resumed run differs"

    # the same resume with PowerSGD's state fresh: the runs part, so the state matters
    fresh = _resume(root)
    group = fresh.grad_sync.group  # type: ignore[attr-defined]
    fresh.grad_sync.hook_state = hook_for(PLAN["compress"], group)[1]  # type: ignore[attr-defined, index]
    _train(fresh, SAVED_AT, STEPS)  # type: ignore[arg-type]
    assert not _same_weights(_weights(fresh), expected)

    # a checkpoint without the state (as saved before it was kept) loads; PowerSGD restarts
    old_root = Path(tmp) / "without-state"
    comm_state = checkpoint_state._comm_state
    checkpoint_state._comm_state = lambda engine, for_load: {}  # type: ignore[assignment]
    try:
        old = CheckpointStore(old_root)
        save(straight, old, STEPS, {"plan": PLAN})
        old.wait()
    finally:
        checkpoint_state._comm_state = comm_state  # type: ignore[assignment]
    assert _powersgd(_resume(old_root)).iter == 0
    dist.barrier()


def test_a_resumed_powersgd_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _powersgd_resume, str(tmp_path))


def test_plait_train_resumed_under_powersgd_logs_the_same_losses(tmp_path: Path) -> None:
    """`plait train --compress powersgd:2`: 6 steps straight (checkpoints after 4 and 6),
    and 6 steps resumed from the checkpoint after step 4, log the very same losses."""
    import json

    from plait.cli.main import main

    small = ["--layers", "2", "--hidden", "64", "--seq-len", "32", "--batch-size", "16",
             "--sample-chars", "0", "--dp", "2", "--pp", "1", "--compress", "powersgd:2",
             "--dtype", "fp32", "--max-steps", "6"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *small, "--run-dir", str(straight), "--checkpoint-every", "4"]) == 0
    checkpoint = straight / "checkpoints" / "step-00000004"
    assert main(["train", *small, "--run-dir", str(resumed), "--resume", str(checkpoint)]) == 0

    def losses(run_dir: Path) -> dict[int, float]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    after = losses(resumed)
    assert sorted(after) == [4, 5]
    assert after == {step: loss for step, loss in losses(straight).items() if step >= 4}
