"""`plait train --plan auto --cluster FILE` plans for the devices the file describes: on a
cluster with one device ten times slower, the plan gives that rank less work than a fast
one (counted by the cost model's FLOPs of the blocks it holds), and the run trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.config import load_config
from plait.config.sections import flat_plan_file
from plait.bench._fault_modes import SLOW_CLUSTER
from plait.cli.main import main
from plait.cost import transformer_block_costs

pytestmark = pytest.mark.dist

_TWO_FAST_ONE_SLOW = SLOW_CLUSTER.replace(
    "devices_per_node = 1", "devices_per_node = 2", 1
).replace("slowdown = 3", "slowdown = 10")
_MODEL = {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16}


def _work(plan: dict, vocab: int) -> tuple[list[float], list[float]]:
    """FLOPs per step of each fast and each slow rank: its blocks' forward and backward
    (`plait.cost.transformer_block_costs`, blocks in model order) × its micro-batches."""
    blocks = transformer_block_costs(
        num_layers=_MODEL["layers"], hidden=_MODEL["hidden"], num_heads=_MODEL["heads"],
        seq_len=_MODEL["seq_len"], vocab_size=vocab, micro_batch_size=plan["micro_batch_size"],
    )  # fmt: skip
    flops = [b.forward_flops + b.backward_input_flops + b.backward_weight_flops for b in blocks]
    fast, slow = [], []
    for pipeline in plan["pipelines"]:
        start = 0
        for device, size in zip(pipeline["devices"], pipeline["partition"], strict=True):
            work = sum(flops[start : start + size]) * pipeline["microbatches"]
            (slow if device == "slow" else fast).append(work)
            start += size
    return fast, slow


def test_plan_auto_gives_the_slow_device_less_work_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plait.train.task import task_from_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixed.toml").write_text(_TWO_FAST_ONE_SLOW)
    run = tmp_path / "run"
    model = [x for k, v in _MODEL.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    argv = ["train", "--nproc", "3", "--cluster", "mixed.toml", *model, "--batch-size", "48",
            "--max-steps", "2", "--sample-chars", "0", "--eval-batches", "0", "--run-dir",
            str(run), "-q"]  # fmt: skip
    assert main(argv) == 0
    plan = flat_plan_file(json.loads((run / "plan.json").read_text()))
    assert plan.get("pipelines"), plan  # a heterogeneous plan: per-pipeline splits
    config = load_config(run / "config.json")
    vocab = task_from_config(config).model().cfg.vocab_size
    fast, slow = _work(plan, vocab)
    assert len(fast) == 2 and len(slow) == 1, plan
    assert slow[0] < max(fast), (fast, slow, plan["pipelines"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["loss"] == row["loss"] for row in rows)  # not NaN
