"""Pipelines of different depths, planned and trained: on a cluster file of one fast
device and two three times slower ones too small for the whole model, the planner picks a
pipeline of one fast rank beside a pipeline of two slow ones, predicted faster than any
plan of one depth; `plait train --plan auto --cluster FILE` picks such a plan from what it
measures here (the file's devices as declared, though its 3 workers share this host's
cores), and `plait train --plan FILE` trains the one `plait plan --out` wrote; both train
the losses of a plain one-process loop over the same model and batches."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.cli.main import main
from plait.config import load_config
from plait.config.sections import flat_plan_file
from plait.plan import SearchSpace, gpt_spec, search
from plait.plan.describe import describe
from plait.presets import load_cluster

pytestmark = pytest.mark.dist

# the slow devices hold half the model, not all of it (so they need a pipeline of two);
# the fast one holds it all
CLUSTER = """name = "one-fast-two-slow"
inter_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }

[[nodes]]
count = 1
devices_per_node = 1
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "fast", peak_flops = { fp32 = 2e10 }, memory_gib = 4 }

[[nodes]]
count = 1
devices_per_node = 2
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "slow", peak_flops = { fp32 = 2e10 }, memory_gib = 0.0014, slowdown = 3 }
"""
MODEL = {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 16}
BATCH, STEPS, LR = 24, 3, 0.1
TOL = {"rtol": 1e-5, "atol": 1e-5}
# plain SGD, no clipping: what the reference below runs
TRAIN = ["--nproc", "3", "--batch-size", str(BATCH), "--max-steps", str(STEPS),
         "--data", "synthetic", "--optimizer", "sgd", "--lr", str(LR), "--weight-decay", "0",
         "--grad-clip", "0", "--deterministic", "--eval-batches", "0",
         "-q"]  # fmt: skip


def _model_flags() -> list[str]:
    return [x for k, v in MODEL.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _depths(run: Path) -> list[int]:
    plan = flat_plan_file(json.loads((run / "plan.json").read_text()))
    return [len(p["partition"]) for p in plan.get("pipelines") or []]


def _losses(run: Path) -> list[float]:
    rows = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in rows]


def _reference(run: Path) -> list[float]:
    """The run's model (its seed) and batches, trained by a plain SGD loop in this process."""
    from plait.train.task import task_from_config

    task = task_from_config(load_config(run / "config.json"))
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, targets = task.batch(step)
        opt.zero_grad()
        logits = model(inputs)  # [batch, seq, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_pick_has_pipelines_of_different_depths_and_beats_one_depth(tmp_path: Path) -> None:
    (tmp_path / "mixed.toml").write_text(CLUSTER)
    model = gpt_spec(num_layers=MODEL["layers"], hidden=MODEL["hidden"],
                     num_heads=MODEL["heads"], seq_len=MODEL["seq_len"], vocab_size=64,
                     dtype="fp32")  # fmt: skip
    found = search(model, load_cluster(tmp_path / "mixed.toml"), global_batch=BATCH,
                   space=SearchSpace(dtype="fp32"))  # fmt: skip
    best = found.best
    assert best.plan.depths == (1, 2), describe(best.plan)
    one_depth = [r for r in found.ranked if len(set(r.plan.depths)) == 1]
    assert one_depth, "the search ranks plans of one depth too"
    assert best.step_time_s < 0.9 * one_depth[0].step_time_s, describe(one_depth[0].plan)


def test_plan_auto_and_a_plan_file_train_pipelines_of_different_depths_as_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixed.toml").write_text(CLUSTER)
    auto = tmp_path / "auto"
    argv = ["train", "--plan", "auto", "--cluster", "mixed.toml", *_model_flags(), *TRAIN,
            "--run-dir", str(auto)]  # fmt: skip
    assert main(argv) == 0
    assert sorted(_depths(auto)) == [1, 2], (auto / "plan.json").read_text()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        argv = ["plan", "--cluster", "mixed.toml", *_model_flags(), "--vocab", "64",
                "--batch-size", str(BATCH), "--dtype", "fp32", "--out", "depths.json"]  # fmt: skip
        assert main(argv) == 0
    planned = tmp_path / "planned"
    assert main(["train", "--plan", "depths.json", *TRAIN, "--run-dir", str(planned)]) == 0
    assert _depths(planned) == [1, 2], (planned / "plan.json").read_text()

    reference = _reference(auto)
    assert reference == _reference(planned)  # one model, one data: the plans differ only
    for run in (auto, planned):
        torch.testing.assert_close(torch.tensor(_losses(run)), torch.tensor(reference), **TOL)
