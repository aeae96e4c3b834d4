"""The clipped gradient norm does not depend on which pipeline rank holds which block: runs
that differ only in their split train the same weights, bit for bit, while clipping is
active at every step. A re-partitioned run (or one resumed on another split) is therefore
the run it would have been without the move (`plait.parallel.clip`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.bench.faults import final_weights
from plait.config import load_config
from plait.train.launch import launch
from plait.train.loop import train_worker

pytestmark = pytest.mark.dist

MAX_NORM = 0.01  # far below the norms of a fresh model's gradients: every step clips


def _config(partition: tuple[int, int]) -> dict[str, Any]:
    return load_config(
        data="synthetic", max_steps=4, checkpoint_every=4, keep=0, batch_size=8,
        grad_clip=MAX_NORM, nproc=2, verbosity=-1,
        **{"model.layers": 4, "model.hidden": 64, "model.heads": 2, "model.seq_len": 16,
           "parallel.pp": 2, "parallel.microbatches": 2,
           "parallel.partition": partition},
    ).to_dict()  # fmt: skip


def test_splits_of_one_model_train_the_same_weights_under_clipping(tmp_path: Path) -> None:
    weights = {}
    for split in ((1, 5), (5, 1)):
        run = tmp_path / f"split-{split[0]}-{split[1]}"
        run.mkdir()
        launch(train_worker, 2, _config(split), str(run))
        norms = [json.loads(line)["grad_norm"]
                 for line in (run / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
        assert len(norms) == 4 and min(norms) > 10 * MAX_NORM, norms  # clipped every step
        weights[split] = final_weights(run)
    first = weights[(1, 5)]
    for split, theirs in weights.items():
        assert theirs.keys() == first.keys()
        for name, tensor in theirs.items():
            assert torch.equal(tensor, first[name]), (split, name)
