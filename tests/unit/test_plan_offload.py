"""Offload inside the planner's search: a plan that fits only with its optimizer state or
activations in host memory is picked where it beats every plan that fits without, as a
brute force over every candidate and option (replayed by the simulator) says; the bounds
that prune offloaded options are below the simulator's step and keep every option that
fits."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import StageCost
from plait.plan import SearchSpace, gpt_spec, search
from plait.plan.estimate import Estimator
from plait.plan.exact import RankedPlan, exact_of
from plait.plan.explain import explain
from plait.plan.offload import OPTIONS, offload_bounds, offloads
from plait.plan.space import candidates
from plait.sim import SimPlan, build_schedule, simulate

FREE = Link(latency_s=0.0, bandwidth_Bps=1e30)
MODEL = gpt_spec(num_layers=4, hidden=256, num_heads=4, seq_len=128, vocab_size=1000)
MARGIN = 0.05


def _cluster(memory: float, *, host: float, devices: int = 1) -> Cluster:
    device = Device(name="u", peak_flops={"fp32": 1e12, "bf16": 1e12}, memory_bytes=int(memory),
                    host_bandwidth_Bps=host)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=devices, intra_node=FREE)
    return Cluster(name="u", groups=(group,), inter_node=FREE)


def _need(**fields: object) -> float:
    """Peak bytes of the whole model on one device under `fields` (the simulator's)."""
    plan = SimPlan(micro_batch_size=1, seq_len=128, **fields)  # type: ignore[arg-type]
    stages = [StageCost(tuple(MODEL.blocks_for(plan)))]
    result = simulate(build_schedule(plan), stages, _cluster(1 << 50, host=1e12), plan)
    return result.ranks[0].memory.total


def _brute_force(cluster: Cluster, space: SearchSpace, batch: int) -> RankedPlan:
    """The fastest plan that fits with the margin over every candidate and every offload
    option, each replayed exactly: no bound, no order."""
    best = None
    plans = candidates(MODEL, space, num_devices=cluster.num_devices,
                       devices_per_node=cluster.num_devices, global_batch=batch)  # fmt: skip
    for plan in plans:
        for option in ({}, *OPTIONS):
            variant = dataclasses.replace(plan, **option)
            r = exact_of(variant, cluster)(variant, MODEL, cluster)
            if not isinstance(r, RankedPlan):
                continue
            pairs = zip(r.peak_memory_bytes, r.capacity_bytes, strict=True)
            fits = all(p <= (1 - MARGIN) * c for p, c in pairs)
            if fits and (best is None or r.step_time_s < best.step_time_s):
                best = r
    assert best is not None
    return best


@pytest.mark.parametrize("host", [1e13, 1e6])
def test_offload_is_picked_where_it_beats_every_plan_that_fits(host: float) -> None:
    """Without recomputation the model fits only with its optimizer state on the host;
    with full recomputation it fits as it is. A fast host link makes the offloaded plan
    the fastest, a slow one the recomputing plan: the search picks what the brute force
    does either way."""
    plain, swapped = _need(recompute="none"), _need(recompute="none", offload_optimizer=True)
    recomputing = _need(recompute="full")
    assert swapped < plain and recomputing < plain
    capacity = (max(swapped, recomputing) + plain) / 2 / (1 - MARGIN)
    assert (1 - MARGIN) * capacity < plain  # the plain plan does not fit
    cluster = _cluster(capacity, host=host)
    space = SearchSpace(micro_batch_sizes=(1, 2), recompute=("none", "full"))
    found = search(MODEL, cluster, global_batch=4, space=space, memory_margin=MARGIN)
    reference = _brute_force(cluster, space, 4)
    # the search prefers the simpler of plans within 0.1% of a step (`_preference`)
    assert found.best.step_time_s == pytest.approx(reference.step_time_s, rel=1e-3)
    assert offloads(found.best.plan) == offloads(reference.plan)
    if host > 1e9:
        assert offloads(found.best.plan) and found.best.plan.recompute == "none"
        assert "fits only with host memory" in explain(found)
        assert "beats the fastest plan without offload" in explain(found)
        plain_space = dataclasses.replace(space, offload=False)
        kept = search(MODEL, cluster, global_batch=4, space=plain_space, memory_margin=MARGIN)
        assert not offloads(kept.best.plan)  # `plait plan --no-offload`
    else:
        assert not offloads(found.best.plan)


@pytest.mark.parametrize(
    "fields",
    [
        {"schedule": "gpipe", "pp": 2, "microbatches": 4, "recompute": "none"},
        {"schedule": "1f1b", "pp": 2, "microbatches": 6, "recompute": "selective"},
        {"schedule": "1f1b", "pp": 1, "microbatches": 2, "recompute": "none", "zero": 1,
         "dp": 2},
        {"schedule": "interleaved", "pp": 2, "chunks": 2, "microbatches": 4,
         "recompute": "full"},
    ],
)  # fmt: skip
def test_offload_bounds_are_below_the_replay_and_keep_every_option_that_fits(
    fields: dict[str, object],
) -> None:
    devices = int(fields.get("pp", 1)) * int(fields.get("dp", 1))  # type: ignore[call-overload]
    plan = SimPlan(micro_batch_size=2, seq_len=128, **fields)  # type: ignore[arg-type]
    roomy = _cluster(1 << 50, host=3e9, devices=devices)
    peaks = {}
    for option in OPTIONS:
        variant = dataclasses.replace(plan, **option)
        r = exact_of(variant, roomy)(variant, MODEL, roomy)
        assert isinstance(r, RankedPlan)
        peaks[tuple(option.items())] = (max(r.peak_memory_bytes), r.step_time_s)
    for capacity in sorted(x[0] for x in peaks.values()):
        bounds = {tuple(o.items()): s for s, o in
                  offload_bounds(plan, MODEL, Estimator(roomy), capacity)}  # fmt: skip
        for key, (peak, step) in peaks.items():
            if peak <= capacity:  # it fits: the bound must keep it, below its replay
                assert key in bounds, (key, peak, capacity)
            if key in bounds:
                assert bounds[key] <= step * (1 + 1e-9), (key, bounds[key], step)
