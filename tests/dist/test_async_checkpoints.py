"""Checkpoints of asynchronous schedules are exact: a PipeDream or 2BW run saves where its
stream flushes (`--flush-every`), so the same run with checkpoints every 2 steps, without
them, and stopped at step 4 then resumed, apply the same updates bit for bit and end with
the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.bench.faults import final_weights
from plait.cli.main import main

pytestmark = pytest.mark.dist

SMALL = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16",
         "--batch-size", "8", "--sample-chars", "0", "--eval-batches", "0", "--pp", "2",
         "--microbatches", "2", "--flush-every", "2", "--dropout", "0.1", "-q"]  # fmt: skip


def _updates(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "updates.jsonl").read_text().splitlines()]
    return [(r["update"], r["loss"]) for r in rows]


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_saving_and_resuming_an_asynchronous_run_changes_nothing(
    tmp_path: Path, schedule: str
) -> None:
    flags = [*SMALL, "--schedule", schedule]
    plain, saved = tmp_path / "plain", tmp_path / "saved"
    # the plain run's one save comes after its last step, where its stream ends anyway
    assert main(["train", "--run-dir", str(plain), "--max-steps", "6",
                 "--checkpoint-every", "6", *flags]) == 0  # fmt: skip
    base = ["train", "--run-dir", str(saved), "--checkpoint-every", "2", *flags]
    assert main([*base, "--max-steps", "4"]) == 0
    assert main([*base, "--max-steps", "6", "--resume", "auto"]) == 0
    want, got = _updates(plain), _updates(saved)
    assert len(want) >= 6 and [u for u, _ in want] == list(range(len(want)))
    assert got == want  # every update's loss, bit for bit
    a, b = final_weights(plain), final_weights(saved)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{schedule}: {name} differs"


def test_an_asynchronous_checkpoint_needs_flushes_that_do_not_depend_on_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", "--pp", "2", "--schedule", "pipedream", "--checkpoint-every", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "checkpoint_every=4" in err and "--flush-every 4" in err
    assert main([*argv, "--flush-every", "3"]) == 2
    assert "not a multiple of flush_every=3" in capsys.readouterr().err
