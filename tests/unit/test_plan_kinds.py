"""The planner searches every registered schedule kind (asynchronous ones only when
staleness is allowed), prunes by bounds, cuts stages unevenly where memory asks for it,
and names the runner-up of each kind: cases checked against closed forms written here."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup, dtype_bytes
from plait.cost import BlockCost, MoEShape
from plait.plan import SearchSpace, gpt_spec, moe_spec, scaled_spec, search
from plait.plan.estimate import Estimate, Estimator
from plait.plan.held import held, least_held
from plait.plan.partition import blocks_fit
from plait.plan.prune import bounds_of, fastest_of_each_kind, pruned_estimates
from plait.plan.runners import RunnerUp, runners_up, runners_up_text
from plait.plan.search import PlanSearch
from plait.plan.space import ModelSpec, candidates
from plait.presets import load_cluster
from plait.schedule import KINDS
from plait.sim import SimPlan

MB = 1e6
FAST = Link(latency_s=1e-9, bandwidth_Bps=1e15)
RATE = 50e12  # achievable FLOP/s: 100 TFLOP/s peak at efficiency 0.5
T = 0.01  # seconds of each pass (forward, input gradient, weight gradient) of a block
P, M = 4, 8  # pipeline ranks (one device each) and micro-batches


def _cluster(memory_bytes: float) -> Cluster:
    device = Device(name="gpu", peak_flops={"bf16": 100e12}, efficiency=0.5,
                    memory_bytes=int(memory_bytes), memory_bandwidth_Bps=1e13)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=1, intra_node=FAST, num_nodes=P)
    return Cluster(name="test", groups=(group,), inter_node=FAST)


def _model(params: int, saved_bytes: float) -> ModelSpec:
    """Eight equal blocks whose forward, input-gradient and weight-gradient passes each
    take T: the equal costs the zero-bubble closed forms assume."""
    block = BlockCost(name="layer", forward_flops=T * RATE, backward_input_flops=T * RATE,
                      backward_weight_flops=T * RATE, activation_bytes=1 * MB,
                      saved_bytes=saved_bytes, num_params=params)  # fmt: skip
    return scaled_spec("uniform", {1: [block] * 2 * P}, seq_len=128, num_heads=1,
                       measured_split={1: [block] * 2 * P})  # fmt: skip


SPACE = SearchSpace(micro_batch_sizes=(1,), recompute=("none",), zero_stages=(0,), chunks=(2,))


def test_default_space_has_every_synchronous_kind_and_asynchronous_only_when_allowed() -> None:
    sync = {k for k, v in KINDS.items() if v.synchronous}
    stale = set(KINDS) - sync
    assert {"zb-h2", "zb-v", "chimera"} <= sync
    assert set(SearchSpace().schedules) == sync
    assert set(SearchSpace(allow_staleness=True).schedules) == sync | stale
    model = _model(1, 1.0)
    plans = {
        p.schedule
        for p in candidates(model, SPACE, num_devices=P, devices_per_node=1, global_batch=M)
    }
    assert plans == sync
    allowed = SearchSpace(micro_batch_sizes=(1,), recompute=("none",), zero_stages=(0,),
                          allow_staleness=True)  # fmt: skip
    plans = {
        p.schedule
        for p in candidates(model, allowed, num_devices=P, devices_per_node=1, global_batch=M)
    }
    assert plans == sync | stale


def test_zb_v_wins_where_its_closed_form_says() -> None:
    """Memory admits only four pipeline stages (model state of two blocks a rank: 2 ×
    16 B × 20 M parameters) and at most eight blocks' activations in flight on a rank,
    which 1F1B's first rank (p micro-batches of two blocks) and ZB-V (as many) respect,
    while ZB-H2 (2p - 1 micro-batches) and Chimera (each rank holds two replicas'
    model state) do not. With m >= 2p - 1 ZB-V has no bubble in its steady state: the
    last rank starts after the first micro-batch's p - 1 forwards of one block, then
    never idles, so its step is (p - 1) · T + m · 6T (each rank runs 2 blocks × 3 passes
    per micro-batch), the least any schedule can take; 1F1B's is (m + p - 1) · 6T,
    ZB-H1's m · 6T + (p - 1) · 2T (Qi et al. 2024: (p - 1)(F + B - W), stage passes 2T)."""
    params, saved = 20_000_000, 36 * MB
    state = 2 * 16 * params  # bf16 weights and gradients, fp32 master weights and Adam
    memory = (state + 8 * saved) / 0.9  # the search keeps 5% free: 10% is safe
    assert state + 14 * saved > 0.95 * memory and 2 * state > 0.95 * memory
    found = search(_model(params, saved), _cluster(memory), global_batch=M, space=SPACE)
    best = found.best
    assert best.plan.schedule == "zb-v" and best.plan.pp == P
    zbv = (P - 1) * T + M * 6 * T
    assert best.step_time_s == pytest.approx(zbv, rel=0.01)
    others = {r.plan.schedule: r.step_time_s for r in reversed(found.ranked)}
    assert others["1f1b"] == pytest.approx((M + P - 1) * 6 * T, rel=0.01)
    assert others["zb-h1"] == pytest.approx(M * 6 * T + (P - 1) * 2 * T, rel=0.01)
    assert "zb-h2" not in others and "chimera" not in others


def test_pruning_by_bounds_keeps_what_estimating_everything_ranks_first() -> None:
    """Against estimating every candidate: the `keep` fastest estimates and the fastest
    estimate of each kind are the same, and every plan set aside does not fit."""
    model = gpt_spec(num_layers=6, hidden=1024, num_heads=8, seq_len=512, vocab_size=8000)
    cluster = load_cluster("dgx-a100-80gb", num_nodes=2)
    space = SearchSpace(micro_batch_sizes=(1, 2, 4), chunks=(2,))
    plans = list(candidates(model, space, num_devices=16, devices_per_node=8, global_batch=64))
    est = Estimator(cluster)
    every = [(est.estimate(p, model.blocks_for(p)), p) for p in plans]
    fitting = sorted((x for x in every if x[0].fits), key=lambda x: x[0].step_s)
    kept, misfits = pruned_estimates(plans, model, cluster, 12, None)
    assert len(kept) < len(fitting)
    ranked = sorted((x for x in kept if x[0].fits), key=lambda x: x[0].step_s)
    assert [p for _, p in ranked[:12]] == [p for _, p in fitting[:12]]
    assert {p for _, p in misfits} == {p for e, p in every if not e.fits}
    fastest = {p.schedule: e.step_s for e, p in reversed(fitting)}
    assert {p.schedule: e.step_s for e, p in fastest_of_each_kind(kept, None)} == fastest


def _bound_alone(plan: SimPlan, model: ModelSpec, est: Estimator) -> Estimate:
    """The bound of one plan, written out (the per-rank arithmetic the planner does for
    many plans at once): state (sharded experts apart, twice for Chimera), in-flight
    activations, transients, weight copies; and the least any cut could hold."""
    profile = est.profile(plan, model.blocks_for(plan))
    experts = 0.0 if profile.experts is None else profile.experts
    state = (profile.params - experts) * est.state_per_param(plan)
    if profile.experts is not None:
        state = state + experts * est.state_per_param(plan, experts=True)
    state = state * (2 if KINDS[plan.schedule].replicated else 1)
    counts, copies = held(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
    pbytes = dtype_bytes(plan.dtype)
    memory = state + counts * profile.saved + profile.transient + copies * profile.params * pbytes
    least, kept = least_held(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
    floor = float(state.sum()) + least * profile.saved_total + kept * profile.params_total * pbytes
    capacity = float(est.device.memory_bytes)
    return Estimate(plan.microbatches * profile.slowest_s, tuple(memory.tolist()), capacity,
                    profile.sizes, other_cut_may_fit=floor <= plan.pp * capacity)  # fmt: skip


def test_bounds_of_many_plans_are_each_plans_bound() -> None:
    """`bounds_of` computes plans that share a cut together: every field of every plan's
    bound is the one written out plan by plan (dense plans of every kind, ZeRO stage and
    recomputation; MoE plans, whose experts' state is sharded apart)."""
    cluster = load_cluster("dgx-a100-80gb", num_nodes=4)
    dense = gpt_spec(num_layers=8, hidden=8192, num_heads=64, seq_len=2048, vocab_size=8000)
    moe = moe_spec(num_layers=4, hidden=4096, num_heads=32, seq_len=2048, vocab_size=8000,
                   moe=MoEShape(num_experts=16, top_k=2))  # fmt: skip
    space = SearchSpace(micro_batch_sizes=(1, 2), chunks=(1, 2), allow_staleness=True)
    for model in (dense, moe):
        plans = list(candidates(model, space, num_devices=32, devices_per_node=8,
                                global_batch=64))  # fmt: skip
        assert len({p.schedule for p in plans}) >= 6
        one = Estimator(cluster)
        expected = [_bound_alone(p, model, one) for p in plans]
        assert bounds_of(plans, model, Estimator(cluster)) == expected
        assert any(e.fits for e in expected)
        assert model is moe or not all(e.fits for e in expected)  # dense: some too big


def test_an_uneven_cut_beats_the_even_one_by_its_closed_form() -> None:
    """Eight equal blocks on two ranks under 1F1B with eight micro-batches. The first rank
    holds two micro-batches' activations, the second one: the even cut (4, 4) fits only
    with full recomputation (a fourth pass T per block), while (3, 5), fewer blocks where
    more activations wait, fits without. 1F1B's step is (m - 1) · T_max + Σ T_r: the even
    cut with recomputation takes 7 · 16T + 32T = 144T, the uneven one 7 · 15T + 24T =
    129T, 15T less; one rank alone (dp = 2) does not fit. The search reaches the uneven
    cut through its estimates (no exhaustive simulation)."""
    params, saved = 12_500_000, 100 * MB  # 200 MB of model state per block
    block_state = 16 * params
    memory = 1590 * MB
    assert 4 * block_state + 8 * saved > memory and 8 * block_state > memory
    assert 5 * block_state + 5 * saved < 0.95 * memory
    space = SearchSpace(schedules=("1f1b",), micro_batch_sizes=(1,), recompute=("none", "full"),
                        zero_stages=(0,))  # fmt: skip
    model = _model(params, saved)
    found = search(model, _cluster(memory), global_batch=M, space=space, num_devices=2,
                   exact_limit=0, max_simulated=4)  # fmt: skip
    best = found.best
    assert (best.plan.pp, best.plan.recompute, best.sizes) == (2, "none", (3, 5))
    assert best.step_time_s == pytest.approx(129 * T, rel=0.01)
    even = next(r for r in found.ranked if r.plan.recompute == "full" and r.sizes == (4, 4))
    assert even.step_time_s - best.step_time_s == pytest.approx(15 * T, rel=0.03)


def _zb_v_case(global_batch: int) -> tuple[PlanSearch, tuple[RunnerUp, ...]]:
    params, saved = 20_000_000, 36 * MB
    memory = (2 * 16 * params + 8 * saved) / 0.9
    model, cluster = _model(params, saved), _cluster(memory)
    found = search(model, cluster, global_batch=global_batch, space=SPACE)
    return found, runners_up(found, model, cluster)


def test_runners_up_say_what_would_make_them_win() -> None:
    """The ZB-V case of `test_zb_v_wins_where_its_closed_form_says` with m = 4 < 2p - 1:
    ZB-V's order, cut to four micro-batches, leaves ZB-H1's (p - 1) · 2T bubble and the
    two tie at 6mT + (p - 1) · 2T = 30T (the simpler, ZB-H1, is chosen). From 2p - 1 = 7
    micro-batches on ZB-V's (p - 1) · T + 6mT is (p - 1) · T = 3T faster than ZB-H1's, a
    win of 6% at m = 8, the first count tried above 4 (doubling). 1F1B's (m + p - 1) · 6T
    is 12T slower than ZB-H1's at every m >= p: it never wins. At m = 8, where ZB-V
    wins, ZB-H1 never would."""
    found, runners = _zb_v_case(4)
    assert found.best.plan.schedule == "zb-h1"
    assert found.best.step_time_s == pytest.approx(M // 2 * 6 * T + (P - 1) * 2 * T, rel=0.01)
    by_kind = {r.kind: r for r in runners}
    assert "zb-h1" not in by_kind and len(by_kind) == len(runners)
    zbv = by_kind["zb-v"]
    assert zbv.step_time_s == pytest.approx(found.best.step_time_s, rel=0.01)
    assert zbv.would_win_if == "zb-v would win at 8 micro-batches per replica or more (now 4)"
    assert by_kind["1f1b"].would_win_if.startswith("1f1b would not win")
    assert by_kind["1f1b"].step_time_s == pytest.approx((4 + P - 1) * 6 * T, rel=0.01)
    _, runners = _zb_v_case(M)
    assert {r.kind: r for r in runners}["zb-h1"].would_win_if.startswith("zb-h1 would not win")
    text = runners_up_text(runners)
    assert text.startswith("Runner-up of each other schedule kind:")
    assert all(f"  {r.kind}: " in text and r.would_win_if in text for r in runners)


def test_plan_json_lists_the_runner_up_of_each_kind(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli.main import main

    args = ["plan", "--layers", "4", "--hidden", "512", "--heads", "8", "--seq-len", "256",
            "--vocab", "8000", "--cluster", "dgx-a100-80gb", "--devices", "4",
            "--batch-size", "16"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    runners = data["runners_up"]
    kinds = [r["kind"] for r in runners]
    assert data["best"]["schedule"] not in kinds and len(set(kinds)) == len(kinds) >= 1
    for r in runners:
        assert set(r) == {"kind", "predicted_step_s", "source", "plan", "would_win_if"}
        assert r["plan"]["schedule"] == r["kind"] and r["predicted_step_s"] > 0
        assert r["would_win_if"].startswith(f"{r['kind']} would ")
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Runner-up of each other schedule kind:" in text
    assert all(r["would_win_if"] in text for r in runners)


def _fits(blocks: list[BlockCost], held: list[int], cap: float, cut: tuple[int, ...]) -> bool:
    state = [16.0 * b.num_params for b in blocks]  # bf16 with fp32 Adam, one rank
    bounds = itertools.pairwise((0, *cut, len(blocks)))
    return all(
        sum(state[a:b]) + held[s] * sum(x.saved_bytes for x in blocks[a:b]) <= cap
        for s, (a, b) in enumerate(bounds)
    )


def test_blocks_fit_is_exact_for_cuts_that_may_leave_stages_empty() -> None:
    """The greedy memory check against all contiguous cuts, counted by hand (block i holds
    16 bytes a parameter and keeps its saved bytes per micro-batch in flight on its
    stage): it says yes exactly when a cut fits if stages may be empty, so it is never no
    when a cut of non-empty stages (what the partitioner needs) fits."""
    rng = random.Random(0)
    for _ in range(80):
        n, k = rng.randint(3, 7), rng.randint(1, 3)
        blocks = [
            BlockCost(name=f"b{i}", forward_flops=1.0, backward_input_flops=1.0,
                      saved_bytes=rng.choice([0.0, 1e8, 3e8]),
                      num_params=rng.choice([1, 2, 4]) * 2_000_000)
            for i in range(n)
        ]  # fmt: skip
        held = [rng.randint(1, 3) for _ in range(k)]
        cap = rng.choice([4, 6, 9]) * 1e8
        device = Device(name="gpu", peak_flops={"bf16": 1e12}, memory_bytes=int(cap))
        any_cut = any(
            _fits(blocks, held, cap, c)
            for c in itertools.combinations_with_replacement(range(n + 1), k - 1)
        )
        non_empty = any(
            _fits(blocks, held, cap, c) for c in itertools.combinations(range(1, n), k - 1)
        )
        assert blocks_fit(blocks, [device] * k, inflight=held) == any_cut
        assert any_cut or not non_empty
