"""Host dispatch in the simulator: each action takes the longer of its device and issue
times, and one process issuing every stage serialises all stages' issue times. The
expected steps are closed forms written here, not the simulator's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost, StageCost
from plait.presets import cluster_from_toml, cluster_to_toml, load_cluster
from plait.profile.dispatch import measure_dispatch, read_dispatch_profile, with_dispatch
from plait.sim import SimPlan, build_schedule, simulate

RATE = 1e12  # achievable FLOP/s of the test device
FREE = Link(latency_s=0.0, bandwidth_Bps=math.inf)


def _cluster(ranks: int, dispatch_s: float) -> Cluster:
    device = Device(name="d", peak_flops={"fp32": RATE}, memory_bytes=1 << 40,
                    dispatch_s=dispatch_s)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=ranks, intra_node=FREE)
    return Cluster(name="host", groups=(group,), inter_node=FREE)


def _stages(p: int, k: int, forward_s: float) -> list[StageCost]:
    """p stages of k blocks, each block `forward_s` of device forward and twice that of
    backward, no parameters (no update, no reduction) and no activations to send."""
    block = BlockCost(name="b", forward_flops=forward_s * RATE,
                      backward_input_flops=forward_s * RATE,
                      backward_weight_flops=forward_s * RATE)  # fmt: skip
    return [StageCost((block,) * k) for _ in range(p)]


def _step(p: int, m: int, k: int, *, forward_s: float, dispatch_s: float, single: bool,
          recompute: str = "none") -> float:  # fmt: skip
    plan = SimPlan(pp=p, schedule="gpipe", microbatches=m, dtype="fp32", optimizer="sgd",
                   recompute=recompute, single_process=single)  # fmt: skip
    cluster = _cluster(p, dispatch_s)
    return simulate(build_schedule(plan), _stages(p, k, forward_s), cluster, plan).step_time_s


@pytest.mark.parametrize(("p", "m", "k"), [(1, 4, 3), (3, 4, 2), (4, 8, 1)])
def test_a_process_per_rank_takes_the_longer_of_device_and_issue(p: int, m: int, k: int) -> None:
    # GPipe over p equal stages: (m + p - 1) forward slots then as many backward slots
    d = 1e-3
    host_bound = _step(p, m, k, forward_s=1e-6, dispatch_s=d, single=False)
    assert host_bound == pytest.approx((m + p - 1) * (k * d + k * d), rel=1e-9)
    # issue faster than the device: the device's times, as without dispatch
    f = 1e-3
    device_bound = _step(p, m, k, forward_s=f, dispatch_s=f / 10, single=False)
    assert device_bound == pytest.approx((m + p - 1) * (k * f + 2 * k * f), rel=1e-9)
    assert device_bound == _step(p, m, k, forward_s=f, dispatch_s=0.0, single=False)


@pytest.mark.parametrize(("p", "m", "k"), [(1, 4, 3), (3, 4, 2), (4, 8, 1)])
def test_one_process_issues_every_stage_on_one_host_timeline(p: int, m: int, k: int) -> None:
    # torchgpipe: every (micro-batch, stage) forward and backward issued by one host, k
    # block issues each; with checkpointing each backward first issues the forward again
    d = 1e-3
    step = _step(p, m, k, forward_s=1e-6, dispatch_s=d, single=True)
    assert step == pytest.approx(m * p * 2 * k * d, rel=1e-9)
    redo = _step(p, m, k, forward_s=1e-6, dispatch_s=d, single=True, recompute="full")
    assert redo == pytest.approx(m * p * 3 * k * d, rel=1e-9)
    # a device-bound pipeline is not slowed by a host that keeps up
    f = 1e-3
    fast_host = _step(p, m, k, forward_s=f, dispatch_s=f / (10 * p), single=True)
    assert fast_host == pytest.approx((m + p - 1) * 3 * k * f, rel=1e-9)


def test_dispatch_s_is_checked_and_kept_by_cluster_files() -> None:
    with pytest.raises(ValueError, match="dispatch_s=-1"):
        Device(name="d", peak_flops={"fp32": 1.0}, memory_bytes=1, dispatch_s=-1)
    cluster = _cluster(2, 2.5e-5)
    text = cluster_to_toml(cluster)
    assert "dispatch_s = 2.5e-05" in text
    assert "dispatch_s" not in cluster_to_toml(_cluster(2, 0.0))  # older files unchanged
    import tomllib

    assert cluster_from_toml(tomllib.loads(text)).device(1).dispatch_s == 2.5e-5
    for preset in ("dgx-a100-80gb", "dgx-h100", "gtx1080ti-pcie"):
        assert load_cluster(preset).device(0).dispatch_s >= 0


def test_measure_dispatch_and_the_profile_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)]
    seconds = measure_dispatch(blocks, torch.randn(1, 4), warmup=1, repeats=3)
    assert 0 < seconds < 1
    assert all(p.grad is None for b in blocks for p in b.parameters())  # left clean
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"device": {"dispatch_s": seconds}}))
    assert read_dispatch_profile(path) == seconds
    cluster = with_dispatch(_cluster(2, 0.0), read_dispatch_profile(path))
    assert {cluster.device(r).dispatch_s for r in range(2)} == {seconds}
    path.write_text(json.dumps({"device": {}}))  # an older profile: the cluster's own figure
    assert (
        with_dispatch(_cluster(2, 3e-6), read_dispatch_profile(path)).device(0).dispatch_s == 3e-6
    )
    path.write_text(json.dumps({"device": {"dispatch_s": -2}}))
    with pytest.raises(ValueError, match="dispatch_s=-2"):
        read_dispatch_profile(path)


def test_profile_measures_dispatch_and_simulate_charges_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from plait.cli.main import main

    small = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--vocab", "96"]
    argv = ["profile", *small, "--repeats", "1", "--warmup", "0", "--codec", "none",
            "--cache-dir", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["device"]["dispatch_s"] > 0
    # a host far slower than this tiny model's device work: 4 blocks (embedding, 2 layers,
    # head) cut 2 + 2, each rank's forward and backward issue 2 blocks of 1 s each, one
    # process per rank: (m + p - 1) slots of forward, then as many of backward
    profile = tmp_path / "slow-host.json"
    profile.write_text(json.dumps({"device": {"dispatch_s": 1.0}}))
    simulate = ["simulate", *small, "--cluster", "local-cpu", "--pp", "2", "--microbatches",
                "4", "--schedule", "gpipe", "--dtype", "fp32", "--json"]  # fmt: skip
    assert main([*simulate, "--profile", str(profile)]) == 0
    step = json.loads(capsys.readouterr().out)["step_time_s"]
    assert step == pytest.approx((4 + 2 - 1) * (2.0 + 2.0), rel=1e-3)
