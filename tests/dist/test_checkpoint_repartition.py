"""A re-partitioned run keeps its split: the checkpoint's `plait.json` and the run's
`plan.json` hold it, a run resumed from the checkpoint trains on it, and ends bit for bit
where the uninterrupted run ends. A move is forced after step 2 (the measured-time policy
would move when a machine's load says so, which a test cannot choose)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.bench.faults import final_weights
from plait.checkpoint.store import published
from plait.config import load_config
from plait.train.launch import launch

pytestmark = pytest.mark.dist

MOVED = (1, 3)  # from the equal split (2, 2) of the 4 blocks (embedding, 2 layers, head)


def _config(max_steps: int, **extra: Any) -> dict[str, Any]:
    return load_config(
        data="synthetic", max_steps=max_steps, checkpoint_every=2, keep=0, batch_size=8,
        repartition="auto", repartition_threshold=1e9,  # no move but the forced one
        nproc=2, verbosity=-1, **extra,
        **{"model.layers": 2, "model.hidden": 32, "model.heads": 2, "model.seq_len": 16,
           "parallel.pp": 2, "parallel.microbatches": 2},
    ).to_dict()  # fmt: skip


def _moved_after_step_2(cfg: dict[str, Any], run_dir: str) -> Any:
    """`train_worker`, with the re-partitioner moving to MOVED after step 2 (index)."""
    from plait.train.loop import train_worker
    from plait.train.repartition import Repartitioner

    def after_step(self: Repartitioner, engine: Any, report: Any, step: int) -> Any:
        return self.move(engine, MOVED, step) if step == 2 else engine

    Repartitioner.after_step = after_step  # type: ignore[method-assign]
    return train_worker(cfg, run_dir)


def _plan(checkpoint: Path) -> dict[str, Any]:
    plan: dict[str, Any] = json.loads((checkpoint / "plait.json").read_text())["plan"]
    return plan


def test_a_resumed_run_keeps_the_split_it_moved_to(tmp_path: Path) -> None:
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    whole.mkdir(), stopped.mkdir()  # `plait train` makes the run folder before the workers
    launch(_moved_after_step_2, 2, _config(8), str(whole))
    launch(_moved_after_step_2, 2, _config(4), str(stopped))  # stopped after step 4
    saved = {p.name: _plan(p)["partition"] for p in published(stopped / "checkpoints")}
    assert saved == {"step-00000004": list(MOVED), "step-00000002": None}
    assert json.loads((stopped / "plan.json").read_text())["pipeline"]["partition"] == list(MOVED)
    # resumed at step 4: no move is forced there, so the split is the checkpoint's or none
    launch(_moved_after_step_2, 2, _config(8, resume="auto"), str(stopped))
    newest = published(stopped / "checkpoints")[0]
    assert newest.name == "step-00000008" and _plan(newest)["partition"] == list(MOVED)
    assert json.loads((stopped / "plan.json").read_text())["pipeline"]["partition"] == list(MOVED)
    theirs, ours = final_weights(whole), final_weights(stopped)
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name
