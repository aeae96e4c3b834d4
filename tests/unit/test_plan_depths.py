"""Pipelines of different depths (HetPipe's virtual workers of unequal size): the planner
picks them where the slow devices need a deeper pipeline than the fast ones, its step
agrees with a closed form, `plait simulate --plan` reproduces it, and their ranks are
consecutive as the runtime places them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.config import PipelineSpec
from plait.pipelines import pipeline_layout
from plait.plan import SearchSpace, gpt_spec, search
from plait.plan.depths import groupings
from plait.plan.describe import describe
from plait.plan.io import plan_to_dict, write_plan
from plait.presets import load_cluster
from plait.sim import SimPlan

# 2 fast devices, 4 three times slower with so little memory that they need a pipeline of
# 4 (half the model on a pair does not fit); links fast enough that compute dominates
CLUSTER = """name = "two-speeds"
inter_node = { latency_s = 1e-5, bandwidth_Bps = 1e10 }

[[nodes]]
count = 1
devices_per_node = 2
intra_node = { latency_s = 1e-6, bandwidth_Bps = 1e11 }
device = { name = "fast", peak_flops = { fp32 = 3e12 }, memory_gib = 16 }

[[nodes]]
count = 1
devices_per_node = 4
intra_node = { latency_s = 1e-6, bandwidth_Bps = 1e11 }
device = { name = "slow", peak_flops = { fp32 = 3e12 }, memory_gib = 0.045, slowdown = 3 }
"""
MODEL = {"name": "gpt", "layers": 8, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 96}
# the options the runtime of pipelines takes, so that both kinds of plan compete alike
SPACE = SearchSpace(dtype="fp32", rank_orders=("tp-dp-pp", "tp-pp-dp"), zero_stages=(0,),
                    schedules=("1f1b",), recompute=("none",), micro_batch_sizes=(1,))  # fmt: skip
BATCH = 48


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, Path]:
    folder = tmp_path_factory.mktemp("depths")
    (folder / "two.toml").write_text(CLUSTER)
    cluster = load_cluster(folder / "two.toml")
    model = gpt_spec(num_layers=8, hidden=256, num_heads=4, seq_len=128, vocab_size=96,
                     dtype="fp32")  # fmt: skip
    found = search(model, cluster, global_batch=BATCH, space=SPACE)
    write_plan(folder / "plan.json", plan_to_dict(found.best, model=MODEL, cluster="two-speeds"))
    return found, folder / "two.toml", folder / "plan.json"


def test_groupings_cut_each_kind_into_equal_consecutive_pipelines() -> None:
    cluster = load_cluster_text(CLUSTER)
    assert groupings(cluster, 6, 10) == [(2, 4), (1, 1, 4), (1, 1, 2, 2), (2, 1, 1, 1, 1)]
    assert groupings(cluster, 6, 3) == [(1, 1, 2, 2), (2, 1, 1, 1, 1)]  # depth <= blocks
    assert groupings(cluster, 4, 10) == [(1, 1, 2), (2, 1, 1)]  # 2 fast, 2 slow ranks


def load_cluster_text(text: str) -> object:
    import tomllib

    from plait.presets import cluster_from_toml

    return cluster_from_toml(tomllib.loads(text))


def test_the_pick_has_pipelines_of_different_depths_and_beats_one_depth(planned: tuple) -> None:
    found, _, _ = planned
    best = found.best
    assert best.plan.depths == (2, 4), describe(best.plan)
    one_depth = [r for r in found.ranked if len(set(r.plan.depths)) == 1]
    assert one_depth, "the search ranks plans of one depth too"
    # figures of this cluster: 30.23 ms against 34.59 ms (dp=1 pp=6)
    assert best.step_time_s < 0.95 * one_depth[0].step_time_s
    assert describe(best.plan).startswith("dp=2 tp=1 pp=2+4 1f1b m=29+19")


def test_the_step_agrees_with_a_closed_form(planned: tuple) -> None:
    """1F1B on stages of times t_s (forward + backward of its blocks at the device's
    speed) takes (m - 1) max t_s + sum t_s; the step is the slowest pipeline's. Sends,
    the reduction and the optimizer step are left out: within 5%."""
    found, path, _ = planned
    cluster = load_cluster(path)
    best = found.best
    model = gpt_spec(num_layers=8, hidden=256, num_heads=4, seq_len=128, vocab_size=96,
                     dtype="fp32")  # fmt: skip
    blocks = model.blocks_for(best.plan)
    flops = [b.forward_flops + b.backward_input_flops + b.backward_weight_flops for b in blocks]
    times, first_rank = [], 0
    for spec in best.plan.pipelines:
        stage_s, first = [], 0
        for s, size in enumerate(spec.partition):
            speed = cluster.device(first_rank + s).achievable_flops("fp32")
            stage_s.append(sum(flops[first : first + size]) / speed)
            first += size
        times.append((spec.microbatches - 1) * max(stage_s) + sum(stage_s))
        first_rank += len(spec.partition)
    assert best.step_time_s == pytest.approx(max(times), rel=0.05)
    assert best.step_time_s >= max(times)  # what was left out only adds


def test_simulate_reproduces_the_plan_files_step(
    planned: tuple, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path, plan_file = planned
    data = json.loads(plan_file.read_text())
    assert [len(p["partition"]) for p in data["pipeline"]["pipelines"]] == [2, 4]
    assert main(["simulate", "--plan", str(plan_file), "--cluster", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["depths"] == [2, 4]
    assert out["step_time_s"] == pytest.approx(data["predicted"]["step_time_s"], rel=1e-9)
    assert main(["simulate", "--plan", str(plan_file), "--cluster", str(path)]) == 0
    assert "pipelines of depths 2+4" in capsys.readouterr().out


def test_ranks_of_pipelines_of_different_depths_are_consecutive() -> None:
    specs = (PipelineSpec(partition=(4,), microbatches=2),
             PipelineSpec(partition=(1, 2, 1), microbatches=4),
             PipelineSpec(partition=(2, 2), microbatches=3))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = SimPlan(dp=3, pp=1, microbatches=2, partition=(4,), pipelines=specs)
    layout = pipeline_layout([s.partition for s in specs], [2, 4, 3])
    assert plan.depths == (1, 3, 2) and plan.world_size == 6
    for d, ranks in enumerate(layout.ranks):
        assert [plan.global_rank(s, d) for s in range(len(ranks))] == list(ranks)
    assert plan.shares == (2, 4, 3) and plan.global_batch_size == 9
    with pytest.raises(ValueError, match=r"pipeline 0 has ranks 0\.\.0"):
        plan.global_rank(1, 0)
