"""Every plan the planner writes with pipelines of their own trains: on a mixed cluster the
plans it ranks (the pick and every alternative a plan file or `--json` can carry) pass the
runtime's check (`plait.pipelines.check_hetero_plan`, run by `ParallelPlan`), so that
`plait train --plan` never stops on ZeRO, tensor parallelism or two stages a rank in a
plan the planner proposed."""

from __future__ import annotations

import tomllib
import warnings

import pytest

from plait.plan import SearchSpace, gpt_spec, search
from plait.plan.describe import describe
from plait.plan.hetero import shares
from plait.plan.io import parallel_plan_of, plan_to_dict
from plait.presets import cluster_from_toml

# one fast device and three slower ones of little memory: the search tries ZeRO, chunked
# schedules and tensor parallelism beside pipelines of their own
MIXED = """name = "one-fast-three-slow"
inter_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }

[[nodes]]
count = 1
devices_per_node = 1
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "fast", peak_flops = { fp32 = 2e10 }, memory_gib = 4 }

[[nodes]]
count = 1
devices_per_node = 3
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "slow", peak_flops = { fp32 = 2e10 }, memory_gib = 0.004, slowdown = 3 }
"""


@pytest.mark.parametrize("layers", [2, 4])
def test_every_ranked_plan_with_pipelines_passes_the_runtime_check(layers: int) -> None:
    cluster = cluster_from_toml(tomllib.loads(MIXED))
    model = gpt_spec(num_layers=layers, hidden=32, num_heads=2, seq_len=16, vocab_size=96,
                     dtype="fp32")  # fmt: skip
    space = SearchSpace(dtype="fp32", rank_orders=("tp-dp-pp", "tp-pp-dp"))
    found = search(model, cluster, global_batch=24, space=space, top_k=1000)
    written = [plan_to_dict(r) for r in found.ranked]
    with_pipelines = [d for d in written if d.get("pipelines")]
    assert with_pipelines, "the search ranks plans of pipelines of their own on a mixed cluster"
    assert any(d["zero"] for d in written), (
        "the search also ranks ZeRO plans (priced as one layout)"
    )
    for ranked, data in zip(found.ranked, written, strict=True):
        if not data.get("pipelines"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                plan = parallel_plan_of(data)
            except ValueError as err:
                pytest.fail(f"{describe(ranked.plan)} is written with pipelines but {err}")
        assert plan.chunks == 1, describe(ranked.plan)  # one stage a rank


def test_shares_give_every_pipeline_a_micro_batch() -> None:
    # rounding each up to one overshoots; the surplus comes from the pipelines above one
    assert shares(4, [10.0, 1.0, 1.0, 1.0]) == [1, 1, 1, 1]
    assert shares(6, [10.0, 1.0, 1.0]) == [4, 1, 1]
