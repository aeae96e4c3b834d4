"""With dropout, every layout (context parallelism's included) trains the GPT to the losses
and gradients of one process on the whole batch: masks keyed by (seed, step, sample, site)
and position do not depend on which rank draws them (plait.keyed). torch's dropout would
give each layout other masks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.config import ParallelPlan
from plait.keyed import drawing
from plait.models import GPT, GPTConfig

from .harness import run_world
from .test_hybrid import _check

pytestmark = pytest.mark.dist

SEED = 11


def _model(dropout: float = 0.2) -> GPT:
    torch.manual_seed(SEED)  # the engine keys its masks by this seed (rank 0's)
    return GPT(GPTConfig(vocab_size=19, seq_len=8, num_layers=2, hidden=16, num_heads=4,
                         dropout=dropout))  # fmt: skip


def _layouts(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for plan in (
        ParallelPlan(dp=2, pp=1, microbatches=2),
        ParallelPlan(pp=2, microbatches=4, schedule="1f1b", recompute="full"),
        ParallelPlan(pp=2, microbatches=2, schedule="zb-h1"),
        ParallelPlan(tp=2, pp=1, microbatches=2),
        ParallelPlan(tp=2, pp=1, microbatches=2, sequence_parallel=True),
        ParallelPlan(dp=2, pp=1, microbatches=1, zero=3, recompute="selective"),
    ):
        _check(plan, build=_model, around=lambda step: drawing(SEED, step, 0))
    # context parallelism: zigzag chunks key every dropout by their tokens' global
    # positions, the ring's attention dropout by each block's global (query, key) positions
    for recompute in ("none", "selective"):  # selective: the ring and its mask run again
        _check(ParallelPlan(cp=2, pp=1, microbatches=2, recompute=recompute),
               build=lambda: _model(dropout=0.1),
               around=lambda step: drawing(SEED, step, 0))  # fmt: skip


def test_dropout_is_the_same_under_every_layout(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _layouts)


def _train(run: Path, *flags: str) -> list[float]:
    """`plait train` in this process: the run is what is checked, not the command's start-up."""
    import json

    from plait.cli.main import main

    small = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16",
             "--batch-size", "8", "--dropout", "0.2", "--sample-chars", "0",
             "--eval-batches", "0", "--device", "cpu", "-q", "--run-dir", str(run)]  # fmt: skip
    with pytest.MonkeyPatch.context() as m:
        m.setenv("OMP_NUM_THREADS", "1")
        assert main(["train", *small, *flags]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_a_resume_under_another_layout_continues_the_same_run(tmp_path: Path) -> None:
    whole = _train(tmp_path / "a", "--nproc", "2", "--dp", "2", "--max-steps", "4")
    half = tmp_path / "b"
    first = _train(half, "--nproc", "2", "--pp", "2", "--max-steps", "2", "--checkpoint-every", "2")
    second = _train(half, "--nproc", "2", "--dp", "2", "--max-steps", "4", "--resume", "auto")
    assert len(whole) == 4 and len(first) == 2
    torch.testing.assert_close(torch.tensor(first + second[-2:]), torch.tensor(whole),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
