"""The planner with the input pipeline's rate: each data-parallel replica loads its own
share of the batch while the devices compute, so a plan's step is max(simulated step,
share / rate); without a rate the search is what it was."""

from __future__ import annotations

import json

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.plan import PlanSearch, SearchSpace, describe, gpt_spec, search
from plait.plan.explain import explain

GIB = 2**30
GLOBAL_BATCH = 8
# two devices on a slow link: a data-parallel all-reduce of every weight costs far more
# than a pipeline's activations, so on device time alone the pipeline wins
_DEVICE = Device(name="gpu", peak_flops={"bf16": 100e12}, efficiency=0.5, memory_bytes=80 * GIB)
_SLOW = Link(latency_s=1e-5, bandwidth_Bps=1e9)
CLUSTER = Cluster(
    name="two-slow",
    groups=(NodeGroup(device=_DEVICE, devices_per_node=1, intra_node=_SLOW, num_nodes=2),),
    inter_node=_SLOW,
)
MODEL = gpt_spec(num_layers=4, hidden=1024, num_heads=8, seq_len=64, vocab_size=1000)
SPACE = SearchSpace(schedules=("1f1b",), recompute=("none",), zero_stages=(0,),
                    micro_batch_sizes=(1, 2, 4), sequence_parallel=(False,))  # fmt: skip


def _search(rate: float | None = None) -> PlanSearch:
    return search(MODEL, CLUSTER, global_batch=GLOBAL_BATCH, space=SPACE,
                  loader_samples_per_s=rate)  # fmt: skip


def _by_plan(found: PlanSearch) -> dict[str, float]:
    return {describe(r.plan): r.step_time_s for r in found.ranked}


def test_a_slow_loader_turns_the_pick_from_a_pipeline_to_data_parallelism() -> None:
    plain = _search()
    assert plain.best.plan.pp == 2 and plain.best.plan.dp == 1, describe(plain.best.plan)
    simulated = _by_plan(plain)
    fastest_dp = min(r.step_time_s for r in plain.ranked if r.plan.dp == 2)
    # a rate at which the pipeline's single loader takes twice the data-parallel step:
    # each of the two replicas loads half the batch, in exactly that step
    rate = GLOBAL_BATCH / (2 * fastest_dp)
    loaded = _search(rate)
    # by hand: every candidate waits for its replica's share of the batch
    expected = {}
    for r in plain.ranked:
        share = GLOBAL_BATCH // r.plan.dp
        expected[describe(r.plan)] = max(simulated[describe(r.plan)], share / rate)
    got = _by_plan(loaded)
    assert got.keys() == expected.keys()
    for plan, step in expected.items():
        assert got[plan] == pytest.approx(step, rel=1e-9), plan
    best = loaded.best
    assert (best.plan.dp, best.plan.pp) == (2, 1), describe(best.plan)
    assert best.step_time_s == pytest.approx(min(expected.values()), rel=1e-9)
    assert best.step_time_s == pytest.approx(fastest_dp, rel=1e-9)
    # the pipeline now takes twice as long: its one loader reads the whole batch
    pipeline = min(v for k, v in got.items() if "pp=2" in k)
    assert pipeline == pytest.approx(GLOBAL_BATCH / rate, rel=1e-9)
    assert pipeline == pytest.approx(2 * fastest_dp, rel=1e-9)


def test_the_explanation_says_when_the_input_bounds_the_step() -> None:
    plain = _search()
    fastest_dp = min(r.step_time_s for r in plain.ranked if r.plan.dp == 2)
    loaded = _search(GLOBAL_BATCH / (4 * fastest_dp))  # every plan waits for input
    assert loaded.best.input_bound and loaded.best.loader_step_s > loaded.best.simulated_step_s
    text = explain(loaded)
    assert "bound by the input pipeline" in text
    assert f"loads {GLOBAL_BATCH // loaded.best.plan.dp} samples" in text
    assert "input" not in explain(plain)


@pytest.mark.parametrize("rate", [None, 0.0])
def test_without_a_rate_the_search_is_unchanged(rate: float | None) -> None:
    plain = search(MODEL, CLUSTER, global_batch=GLOBAL_BATCH, space=SPACE)
    again = _search(rate)
    assert [(r.plan, r.step_time_s, r.mfu, r.tokens_per_s) for r in again.ranked] == [
        (r.plan, r.step_time_s, r.mfu, r.tokens_per_s) for r in plain.ranked
    ]
    assert all(r.loader_step_s == 0 and not r.input_bound for r in again.ranked)
    assert explain(again) == explain(plain)


def test_a_fast_loader_changes_no_step() -> None:
    plain = _search()
    loaded = _search(1e12)  # a nanosecond per sample: never the bound
    assert _by_plan(loaded) == _by_plan(plain)
    assert not any(r.input_bound for r in loaded.ranked)


@pytest.mark.parametrize("rate", [-1.0, float("nan"), float("inf")])
def test_a_bad_rate_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="loader_samples_per_s="):
        _search(rate)


def test_plan_cli_takes_a_loader_rate(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli.main import main

    argv = ["plan", "--cluster", "local-cpu", "--batch-size", "8", "--layers", "2",
            "--hidden", "64", "--heads", "2", "--seq-len", "16", "--vocab", "100",
            "--json"]  # fmt: skip
    assert main([*argv, "--loader-rate", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["best"]
    share = best["global_batch"] // best["dp"]
    predicted = best["predicted"]
    # 2 samples/s: seconds of loading against milliseconds of compute
    assert predicted["loader_step_s"] == pytest.approx(share / 2)
    assert predicted["step_time_s"] == pytest.approx(max(predicted["simulated_step_s"], share / 2))
    assert best["dp"] == out["num_devices"] and best["pp"] == 1
    assert "bound by the input pipeline" in out["explanation"]
