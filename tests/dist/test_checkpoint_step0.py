"""A checkpoint of step 0 (saved before the first step: the initial weights, no optimizer
state yet) resumes bit for bit, for the engine and for `plait train --checkpoint-start`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.checkpoint import CheckpointStore
from plait.train.checkpointing import resume, save

from .harness import run_world
from .test_checkpoint import _engine, _sgd, _train, _weights

pytestmark = pytest.mark.dist


def _step0(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    for name, optimizer, plan in [
        ("adamw", None, {"pp": 2, "microbatches": 2}),
        ("sgd-momentum", _sgd, {"pp": 2, "microbatches": 2}),
        ("2bw", None, {"pp": 2, "microbatches": 2, "schedule": "2bw"}),
        ("zero1", None, {"dp": 2, "pp": 1, "microbatches": 2, "zero": 1}),
    ]:
        root = Path(tmp) / name
        store = CheckpointStore(root)
        kw = {} if optimizer is None else {"optimizer": optimizer}
        straight = _engine(**kw, **plan)
        save(straight, store, 0, {"plan": plan})  # before any step: no optimizer state yet
        store.wait()
        _train(straight, 0, 3)
        straight.drain()
        resumed = _engine(**kw, **plan)
        with torch.no_grad():  # whatever it starts from, the checkpoint's weights win
            for stage in resumed.stages.values():
                for p in stage.parameters():
                    p.add_(1.0)
        found = resume(resumed, CheckpointStore(root), "auto")
        assert found is not None and found.step == 0, name
        _train(resumed, 0, 3)
        resumed.drain()
        unsaved = _engine(**kw, **plan)  # the save must not change the run that made it
        _train(unsaved, 0, 3)
        unsaved.drain()
        a, b, c = _weights(straight), _weights(resumed), _weights(unsaved)
        for index in a:
            for p, q, r in zip(a[index], b[index], c[index], strict=True):
                assert torch.equal(p, q), f"{name}: block {index} differs after resuming"
                assert torch.equal(p, r), f"{name}: block {index} differs for the save"
    dist.barrier()


def test_a_step_0_checkpoint_resumes_bit_identical(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _step0, str(tmp_path))


def test_plait_train_saves_step_0_and_resumes_from_it(tmp_path: Path) -> None:
    from plait.bench.faults import final_weights
    from plait.checkpoint.store import published
    from plait.cli.main import main

    flags = ["--data", "synthetic", "--layers", "2", "--hidden", "32", "--heads", "2",
             "--seq-len", "16", "--batch-size", "8", "--pp", "2", "--microbatches", "2",
             "--max-steps", "3", "--checkpoint-every", "3", "--keep", "0", "-q"]  # fmt: skip
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["train", *flags, "--checkpoint-start", "--run-dir", str(whole)]) == 0
    saved = published(whole / "checkpoints")
    assert [p.name for p in saved] == ["step-00000003", "step-00000000"]
    step0 = str(saved[1])
    assert main(["train", *flags, "--resume", step0, "--run-dir", str(resumed)]) == 0
    assert [p.name for p in published(resumed / "checkpoints")] == ["step-00000003"]
    theirs, ours = final_weights(whole), final_weights(resumed)
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name
