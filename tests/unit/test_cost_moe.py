"""The MoE cost model: FLOPs, parameters and all-to-all bytes of a MoE layer worked out by
hand, parameter counts against the real `MoEGPT`, and the simulator charging the token
all-to-all over the ep group and expert gradients over the expert-data-parallel group."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import Collective, MoEShape, StageCost, moe_block_costs
from plait.presets import load_cluster
from plait.profile import MoESpec
from plait.sim import SimPlan, SimResult, build_schedule, simulate

# (hidden, heads, seq_len, micro-batch, experts, top_k, capacity, imbalance, shared, ep, dtype)
SIZES = [
    (64, 4, 32, 1, 4, 2, 1.25, 1.0, False, 1, "fp32"),
    (128, 8, 16, 2, 8, 1, 1.0, 1.5, False, 2, "bf16"),  # imbalance capped by capacity
    (96, 6, 24, 3, 6, 2, 0.0, 1.3, True, 3, "bf16"),  # dropless: imbalance counts in full
    (64, 4, 32, 2, 4, 2, 2.0, 1.5, True, 4, "fp32"),  # capacity above the imbalance
]


@pytest.mark.parametrize("size", SIZES)
def test_moe_layer_flops_params_and_all_to_all_by_hand(size: tuple) -> None:
    h, a, s, b, e, k, c, imbalance, shared, ep, dtype = size
    f, width, v = 4 * h, 4 if dtype == "fp32" else 2, 96
    moe = MoEShape(num_experts=e, top_k=k, capacity_factor=c, moe_every=2,
                   shared_expert=shared, imbalance=imbalance)  # fmt: skip
    blocks = moe_block_costs(num_layers=4, hidden=h, num_heads=a, seq_len=s, vocab_size=v,
                             moe=moe, micro_batch_size=b, dtype=dtype,
                             layout=SimPlan(dp=ep, ep=ep))  # fmt: skip
    assert [x.name for x in blocks] == ["embedding", "layer0", "layer1", "layer2", "layer3", "head"]
    layer = blocks[2]  # layer1: (1 + 1) % 2 == 0, a MoE layer
    tokens = b * s
    rho = min(imbalance, c) if c > 0 else imbalance  # copies on the busiest rank over tokens·k
    gemms = (
        2 * tokens * (3 * h) * h  # QKV
        + 2 * tokens * h * h  # attention output projection
        + 2 * tokens * h * e  # router
        + tokens * k * rho * (2 * h * f + 2 * f * h)  # each kept copy: both expert GEMMs
        + (2 * tokens * h * f + 2 * tokens * f * h if shared else 0)
    )
    scores = 2 * tokens * s * h + 2 * tokens * s * h  # QKᵀ and attention × V
    assert layer.forward_flops == pytest.approx(gemms + scores, rel=1e-12)
    assert layer.backward_weight_flops == pytest.approx(gemms, rel=1e-12)
    assert layer.backward_input_flops == pytest.approx(gemms + 2 * scores, rel=1e-12)

    one_expert = h * f + f + f * h + h
    experts_here = (e // ep) * one_expert
    params = (3 * h * h + 3 * h) + (h * h + h) + 2 * 2 * h + h * e + experts_here
    params += one_expert if shared else 0
    assert layer.num_params == params
    assert layer.expert_params == experts_here

    if ep == 1:
        assert layer.forward_comm == () and layer.backward_comm == ()
    else:  # dispatch and combine, forward and backward: every copy's hidden vector
        counts, *forward = layer.forward_comm  # the forward first exchanges E int64 counts
        assert (counts.kind, counts.axis, counts.num_bytes) == ("all_to_all", "ep", 8 * e)
        for comm in (forward, layer.backward_comm):
            assert [(x.kind, x.axis) for x in comm] == [("all_to_all", "ep")] * 2
            assert all(x.num_bytes == tokens * k * h * width for x in comm)
    dense = blocks[1]  # layer0 is dense: a GPT layer
    assert dense.expert_params == 0 and dense.forward_comm == ()
    assert dense.num_params == 4 * h * h + 2 * h * f + 9 * h + f


@pytest.mark.parametrize(("tp", "ep", "shared"), [(2, 2, True), (4, 1, False), (2, 4, False)])
def test_moe_layer_under_tensor_parallelism_by_hand(tp: int, ep: int, shared: bool) -> None:
    """Attention and the shared expert sharded by tp, the router whole, the experts whole
    but fed 1/tp of the tokens; the layer's output all-gathered over tp."""
    h, a, s, b, e, k, width = 64, 4, 32, 2, 4, 2, 2
    f, tokens = 4 * h, b * s
    moe = MoEShape(num_experts=e, top_k=k, capacity_factor=1.0, moe_every=1,
                   shared_expert=shared)  # fmt: skip
    layout = SimPlan(dp=max(1, ep // tp), tp=tp, ep=ep)  # ep borrows dp × tp ranks
    layer = moe_block_costs(num_layers=1, hidden=h, num_heads=a, seq_len=s, vocab_size=96,
                            moe=moe, micro_batch_size=b, layout=layout)[1]  # fmt: skip
    gemms = (
        (2 * tokens * 4 * h * h + (4 * tokens * h * f if shared else 0)) / tp
        + 2 * tokens * h * e  # the router sees every token on every tp rank
        + tokens * k / tp * 4 * h * f  # this rank's slice of the copies (ρ = 1)
    )
    # the forward first exchanges the E per-expert counts (int64); the backward does not
    counts = (Collective(kind="all_to_all", num_bytes=8 * e, axis="ep"),) if ep > 1 else ()
    assert layer.forward_comm == counts + layer.backward_comm
    assert layer.backward_weight_flops == pytest.approx(gemms, rel=1e-12)
    assert layer.forward_flops == pytest.approx(gemms + 4 * tokens * s * h / tp, rel=1e-12)
    one_expert = 2 * h * f + f + h
    sharded = 4 * h * h + 3 * h + ((2 * h * f + f) if shared else 0)  # q, k, v biases sharded
    whole = h + 4 * h + h * e + (e // ep) * one_expert + (h if shared else 0)
    assert layer.num_params == sharded // tp + whole
    kinds = sorted((c.kind, c.axis, c.num_bytes) for c in layer.backward_comm)
    expected = [("all_reduce", "tp", tokens * h * width)] * (2 if shared else 1)
    expected.append(("all_gather", "tp", tokens * h * width))
    if ep > 1:
        expected += [("all_to_all", "ep", tokens * k * h * width / tp)] * 2
    assert kinds == sorted(expected)


def test_analytic_parameters_equal_the_real_model() -> None:
    from plait.models.moe import MoEConfig, MoEGPT

    for shared, e in ((False, 4), (True, 6)):
        every = 2 if shared else 1
        cfg = MoEConfig(vocab_size=96, seq_len=32, num_layers=3, hidden=64, num_heads=4,
                        num_experts=e, top_k=2, moe_every=every, shared_expert=shared)  # fmt: skip
        model = MoEGPT(cfg)
        spec = MoESpec(num_layers=3, hidden=64, num_heads=4, seq_len=32, vocab_size=96,
                       num_experts=e, moe_every=every, shared_expert=shared)  # fmt: skip
        blocks = spec.block_costs(dtype="fp32")
        for cost, module in zip(blocks, model.blocks(), strict=True):
            assert cost.num_params == sum(p.numel() for p in module.parameters()), cost.name
        assert spec.num_params() == model.num_params()
        # under ep=2 a rank holds half of each MoE layer's experts
        halves = spec.block_costs(dtype="fp32", layout=SimPlan(dp=2, ep=2))
        for whole, half in zip(blocks, halves, strict=True):
            assert whole.num_params - half.num_params == whole.expert_params // 2


def _cluster(link: Link, *, devices: int = 4, memory_bandwidth: float = 1e12) -> Cluster:
    device = Device(name="toy", peak_flops={"fp32": 1e12, "bf16": 1e12}, efficiency=1.0,
                    memory_bytes=80 * 2**30, memory_bandwidth_Bps=memory_bandwidth)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=devices, intra_node=link, num_nodes=1)
    return Cluster(name="slow", groups=(group,), inter_node=link)


def _ring_or_tree(n: int, num_bytes: float, link: Link) -> float:
    """NCCL-style best of ring and binary-tree all-reduce, by hand."""
    if n == 1:
        return 0.0
    beta, alpha = num_bytes / link.bandwidth_Bps, link.latency_s
    ring = 2 * (n - 1) / n * beta + 2 * (n - 1) * alpha
    tree = 2 * math.ceil(math.log2(n)) * alpha + 2 * beta
    return min(ring, tree)


SPEC = MoESpec(num_layers=2, hidden=64, num_heads=4, seq_len=32, vocab_size=96,
               num_experts=4, top_k=2, moe_every=1)  # fmt: skip
SLOW = Link(latency_s=1e-3, bandwidth_Bps=1e8)


def _step(
    ep: int, *, dp: int, m: int, zero: int = 0, dtype: str = "fp32", cluster: Cluster | None = None
) -> tuple[SimResult, StageCost]:
    plan = SimPlan(dp=dp, ep=ep, microbatches=m, dtype=dtype, seq_len=32, zero=zero)
    stage = StageCost(tuple(SPEC.block_costs(dtype=dtype, layout=plan)))
    cluster = cluster or _cluster(SLOW, devices=dp)
    return simulate(build_schedule(plan), [stage], cluster, plan), stage


def test_ep2_step_differs_from_ep1_by_the_all_to_all_it_adds_and_the_sync_it_saves(
    tmp_path: Path,
) -> None:
    """dp = ep = 2 on one slow link: ep=2 adds five all-to-alls per MoE layer and micro-
    batch (the counts, then dispatch and combine forward and backward), and removes the
    expert-gradient all-reduce (each rank's experts are its own: the expert-data-parallel
    group has one rank) and half of the experts' optimizer step.
    With one pipeline stage nothing overlaps the reduction (it follows the last backward),
    and the all-to-alls sit inside the forward and backward passes (the cost model does
    not overlap them with expert compute), so the difference is exactly those three
    terms. The cluster is a file, as a user would give it."""
    m, h, tokens, k, e, f = 3, 64, 32, 2, 4, 256
    alpha, bw = 2e-3, 5e7
    path = tmp_path / "slow.toml"
    path.write_text(
        'name = "slow"\n'
        f"inter_node = {{ latency_s = {alpha}, bandwidth_Bps = {bw} }}\n"
        "[[nodes]]\ncount = 1\ndevices_per_node = 2\n"
        f"intra_node = {{ latency_s = {alpha}, bandwidth_Bps = {bw} }}\n"
        '[nodes.device]\nname = "toy"\nefficiency = 1.0\nmemory_bytes = 80_000_000_000\n'
        "memory_bandwidth_Bps = 1e12\npeak_flops = { fp32 = 1e12 }\n"
    )
    cluster = load_cluster(path)
    one, _ = _step(1, dp=2, m=m, cluster=cluster)
    two, _ = _step(2, dp=2, m=m, cluster=cluster)
    slow = Link(latency_s=alpha, bandwidth_Bps=bw)
    a2a = (2 - 1) / 2 * tokens * k * h * 4 / bw + (2 - 1) * alpha  # one all-to-all, fp32
    counts = (2 - 1) / 2 * e * 8 / bw + (2 - 1) * alpha  # the E int64 counts first
    added = m * 2 * (4 * a2a + counts)  # two MoE layers, five all-to-alls each
    expert_params = 2 * e * (2 * h * f + f + h)  # both layers' experts at ep=1
    saved_sync = _ring_or_tree(2, expert_params * 4, slow)
    adam_fp32 = 4 + 4 + 2 * 8  # read gradient and state, write state, write parameter
    saved_optimizer = expert_params / 2 * adam_fp32 / 1e12
    expected = added - saved_sync - saved_optimizer
    assert two.step_time_s - one.step_time_s == pytest.approx(expected, rel=1e-9)
    assert two.ranks[0].ep_comm_s == pytest.approx(added, rel=1e-12)
    assert one.ranks[0].ep_comm_s == 0.0
    assert two.all_to_all_share == pytest.approx(added / two.step_time_s, rel=1e-12)


def test_expert_gradients_sync_over_the_expert_data_parallel_group() -> None:
    """dp=4, ep=2: non-expert gradients all-reduce over 4 ranks, expert gradients over the
    2 ranks holding the same experts; ZeRO-1 shards each part's optimizer state likewise."""
    result, stage = _step(2, dp=4, m=1, zero=1, dtype="bf16")
    h, f, e = 64, 256, 4
    experts = 2 * (e // 2) * (2 * h * f + f + h)
    assert stage.expert_params == experts
    rest = stage.num_params - experts

    # ZeRO-1: reduce-scatter then all-gather of each part, (n-1)/n·B/bw + (n-1)·alpha each
    def ring_pass(n: int, num_bytes: float) -> float:
        return (n - 1) / n * num_bytes / SLOW.bandwidth_Bps + (n - 1) * SLOW.latency_s

    expected = 2 * ring_pass(4, rest * 2) + 2 * ring_pass(2, experts * 2)
    assert result.ranks[0].dp_comm_s == pytest.approx(expected, rel=1e-12)
    wrong = 2 * ring_pass(4, stage.num_params * 2)  # everything over dp
    assert abs(result.ranks[0].dp_comm_s - wrong) > 1e-3 * wrong
    memory = result.ranks[0].memory  # bf16 + Adam: 2 + 2 bytes whole, 12 sharded
    assert memory.params == pytest.approx(2 * stage.num_params, rel=1e-12)
    assert memory.optimizer == pytest.approx(12 * rest / 4 + 12 * experts / 2, rel=1e-12)


@pytest.mark.parametrize(("dp", "ep", "zero"), [(2, 1, 0), (2, 2, 0), (4, 2, 1), (4, 4, 3)])
def test_the_estimator_charges_experts_as_the_simulator_does(dp: int, ep: int, zero: int) -> None:
    """One stage, one micro-batch in flight: the planner's closed form has no pipeline to
    approximate, so its step (compute, all-to-alls, both reductions, the optimizer) and
    memory must equal the simulator's (ZeRO-3 included for the step: its gathers of the
    non-expert weights over dp, of the experts over dp / ep)."""
    from plait.cost import MoEShape
    from plait.plan import moe_spec
    from plait.plan.estimate import Estimator

    model = moe_spec(num_layers=2, hidden=64, num_heads=4, seq_len=32, vocab_size=96,
                     moe=MoEShape(num_experts=4, top_k=2, moe_every=1), dtype="bf16")  # fmt: skip
    plan = SimPlan(dp=dp, ep=ep, microbatches=3, dtype="bf16", seq_len=32, zero=zero)
    cluster = _cluster(SLOW, devices=dp)
    blocks = model.blocks_for(plan)
    guess = Estimator(cluster).estimate(plan, blocks)
    exact = simulate(build_schedule(plan), [StageCost(blocks)], cluster, plan)
    assert guess.step_s == pytest.approx(exact.step_time_s, rel=1e-9)
    if zero < 3:  # the closed form leaves out ZeRO-3's gathered weights, for any model
        assert guess.memory_bytes[0] == pytest.approx(exact.peak_memory_bytes[0], rel=1e-9)
