"""The analytic cost model: collectives, ZeRO memory, transformer FLOPs and bytes, blocks."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from plait.cluster import Device, Link
from plait.config import ParallelPlan
from plait.cost import (
    AxisLinks,
    BlockCost,
    Collective,
    StageCost,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_time,
    group_collective_time,
    layer_activation_bytes,
    model_state_bytes,
    optimizer_step_time,
    p2p_time,
    reduce_scatter_time,
    ring_all_reduce_time,
    stage_costs,
    transformer_block_costs,
    tree_all_reduce_time,
)
from plait.cost.transformer import TransformerShape
from plait.presets import load_cluster

ALPHA, BW = 1e-5, 1e10
LINK = Link(latency_s=ALPHA, bandwidth_Bps=BW)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_collective_formulas(n: int) -> None:
    size = 3e8
    assert ring_all_reduce_time(n, size, LINK) == pytest.approx(
        2 * (n - 1) / n * size / BW + 2 * (n - 1) * ALPHA
    )
    assert tree_all_reduce_time(n, size, LINK) == pytest.approx(
        2 * math.ceil(math.log2(n)) * ALPHA + 2 * size / BW
    )
    one_way = (n - 1) / n * size / BW + (n - 1) * ALPHA
    assert reduce_scatter_time(n, size, LINK) == pytest.approx(one_way)
    assert all_gather_time(n, size, LINK) == pytest.approx(one_way)
    assert all_to_all_time(n, size, LINK) == pytest.approx(one_way)
    # reduce-scatter then all-gather is a ring all-reduce
    assert 2 * one_way == pytest.approx(ring_all_reduce_time(n, size, LINK))
    best = all_reduce_time(n, size, LINK)
    assert best == min(ring_all_reduce_time(n, size, LINK), tree_all_reduce_time(n, size, LINK))
    assert (
        collective_time(Collective(kind="all_gather", num_bytes=size, axis="tp"), n, LINK)
        == one_way
    )


def test_tree_wins_on_latency_ring_on_bandwidth() -> None:
    assert tree_all_reduce_time(64, 1e3, LINK) < ring_all_reduce_time(64, 1e3, LINK)
    assert ring_all_reduce_time(4, 1e9, LINK) < tree_all_reduce_time(4, 1e9, LINK)
    assert ring_all_reduce_time(1, 1e9, LINK) == 0.0 == all_to_all_time(1, 1e9, LINK)
    with pytest.raises(ValueError, match="algorithm='star'"):
        all_reduce_time(4, 1.0, LINK, algorithm="star")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n=0"):
        ring_all_reduce_time(0, 1.0, LINK)


def test_group_link_is_the_bottleneck() -> None:
    cluster = load_cluster("dgx-a100-80gb", num_nodes=2)
    ar = Collective(kind="all_reduce", num_bytes=1e9, axis="dp")
    inside = group_collective_time(cluster, range(8), ar)
    across = group_collective_time(cluster, [0, 1, 2, 3, 8, 9, 10, 11], ar)
    assert inside == pytest.approx(all_reduce_time(8, 1e9, cluster.groups[0].intra_node))
    assert across == pytest.approx(all_reduce_time(8, 1e9, cluster.inter_node))
    assert across > 10 * inside
    assert p2p_time(cluster, 0, 1, 3e8) == pytest.approx(5e-6 + 3e8 / 300e9)
    assert p2p_time(cluster, 0, 8, 3e8) == pytest.approx(5e-6 + 3e8 / 25e9)


@pytest.mark.parametrize("dp", [1, 2, 8, 64])
def test_zero_memory_formulas(dp: int) -> None:
    psi = 7.5e9
    stages = [model_state_bytes(psi, dtype="fp16", zero_stage=z, dp=dp).total for z in range(4)]
    assert stages[0] == 16 * psi
    assert stages[1] == pytest.approx(4 * psi + 12 * psi / dp)
    assert stages[2] == pytest.approx(2 * psi + 14 * psi / dp)
    assert stages[3] == pytest.approx(16 * psi / dp)
    fp32 = model_state_bytes(psi, dtype="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    assert model_state_bytes(psi, dtype="bf16", optimizer="sgd").total == 12 * psi


def test_zero_paper_example() -> None:
    """ZeRO Figure 1: 7.5B parameters on 64 GPUs: 120 GB, 31.4, 16.6 and 1.88 GB."""
    psi, n = 7.5e9, 64
    expected = [120e9, 31.4e9, 16.6e9, 1.88e9]
    for stage, want in enumerate(expected):
        got = model_state_bytes(psi, zero_stage=stage, dp=n).total
        assert got == pytest.approx(want, rel=0.01)
    with pytest.raises(ValueError, match="zero_stage=4"):
        model_state_bytes(psi, zero_stage=4)


def test_optimizer_step_is_memory_bound() -> None:
    device = Device(name="d", peak_flops={"bf16": 1e12}, memory_bytes=1, memory_bandwidth_Bps=1e12)
    assert optimizer_step_time(1e9, device) == pytest.approx(28e9 / 1e12)
    assert optimizer_step_time(1e9, device, zero_stage=1, dp=4) == pytest.approx(7e9 / 1e12)


def _shape(**kw: object) -> TransformerShape:
    base: dict[str, object] = dict(
        num_layers=2, hidden=1024, num_heads=16, seq_len=2048, vocab_size=50000, micro_batch_size=2
    )
    base.update(kw)
    return TransformerShape(**base)  # type: ignore[arg-type]


def test_transformer_flops_follow_narayanan() -> None:
    b, s, h, v, layers = 2, 2048, 1024, 50000, 2
    blocks = transformer_block_costs(
        num_layers=layers, hidden=h, num_heads=16, seq_len=s, vocab_size=v, micro_batch_size=b
    )
    assert [blk.name for blk in blocks] == ["embedding", "layer0", "layer1", "head"]
    layer = blocks[1]
    assert layer.forward_flops == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    backward = layer.backward_input_flops + layer.backward_weight_flops
    assert backward == pytest.approx(2 * layer.forward_flops)
    assert layer.num_params == 12 * h * h + 13 * h
    total = sum(
        blk.forward_flops + blk.backward_input_flops + blk.backward_weight_flops for blk in blocks
    )
    # Narayanan et al. 2021, eq. 3 without recomputation: 72·B·s·l·h²(1 + s/6h + V/12lh)
    narayanan = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert total == pytest.approx(narayanan)


def _layer(layout: ParallelPlan | None = None, hidden: int = 1024) -> BlockCost:
    return transformer_block_costs(num_layers=1, hidden=hidden, num_heads=16, seq_len=512,
                                   vocab_size=32000, layout=layout)[1]  # fmt: skip


def test_tensor_parallel_divides_work_and_adds_collectives() -> None:
    one, four = _layer(), _layer(ParallelPlan(tp=4))
    assert four.forward_flops == pytest.approx(one.forward_flops / 4)
    assert [c.kind for c in four.forward_comm] == ["all_reduce", "all_reduce"]
    assert four.forward_comm[0].num_bytes == 512 * 1024 * 2
    sp = _layer(ParallelPlan(tp=4, sequence_parallel=True))
    kinds = [c.kind for c in sp.backward_comm]
    assert kinds == ["all_gather", "reduce_scatter"] * 2
    assert one.forward_comm == () and one.backward_comm == ()
    with pytest.raises(ValueError, match="num_heads=16 is not divisible by tp=3"):
        _layer(ParallelPlan(tp=3), hidden=1032)


def test_activation_bytes_follow_korthikanti() -> None:
    s, b, h, a, t = 2048, 2, 1024, 16, 8
    sbh = s * b * h
    # Korthikanti et al. leave out the norms' means and rstds: 4·s·b elements of a layer
    approx = functools.partial(pytest.approx, rel=1e-3)
    # the published accounting is plait's at 16 bits with dropout on (bool masks on CUDA)
    plain = _shape(dropout=0.1)
    assert layer_activation_bytes(plain, "none") == approx(sbh * (34 + 5 * a * s / h))
    assert layer_activation_bytes(plain, "selective") == approx(34 * sbh)
    assert layer_activation_bytes(plain, "full") == approx(2 * sbh)
    tp = _shape(layout=ParallelPlan(tp=t), dropout=0.1)
    expected = sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(tp, "none") == approx(expected)
    assert layer_activation_bytes(tp, "selective") == approx(sbh * (10 + 24 / t))
    sp = _shape(layout=ParallelPlan(tp=t, sequence_parallel=True), dropout=0.1)
    assert layer_activation_bytes(sp, "none") == approx(sbh / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(sp, "selective") == approx(34 * sbh / t)
    assert layer_activation_bytes(sp, "full") == approx(2 * sbh / t)
    assert layer_activation_bytes(_shape(dtype="fp32"), "full") == approx(4 * sbh)
    # without dropout: no masks, and the fused attention keeps an fp32 log-sum-exp, not the
    # s² scores: 16 activations of s·b·h elements and the norms' 4·s·b statistics
    for dtype, width in (("bf16", 2), ("fp32", 4)):
        expected = width * (16 * sbh + 4 * s * b) + 4 * a * s * b
        assert layer_activation_bytes(_shape(dtype=dtype), "none") == pytest.approx(expected)


def test_block_from_seconds_round_trips_on_its_device() -> None:
    ref = Device(name="ref", peak_flops={"fp32": 1e12}, efficiency=0.5, memory_bytes=1)
    fast = Device(name="fast", peak_flops={"fp32": 4e12}, efficiency=0.5, memory_bytes=1)
    block = BlockCost.from_seconds(
        "conv",
        forward_s=0.01,
        backward_input_s=0.01,
        backward_weight_s=0.02,
        device=ref,
        dtype="fp32",
        activation_bytes=1e6,
        saved_bytes=5e6,
    )
    assert block.source.startswith("measured on ref")
    on_ref = StageCost((block,)).times(ref, "fp32")
    assert (on_ref.forward_s, on_ref.backward_s) == pytest.approx((0.01, 0.03))
    on_fast = StageCost((block,)).times(fast, "fp32")
    assert on_fast.forward_s == pytest.approx(0.0025)


def test_recompute_variants_of_a_stage() -> None:
    blocks = transformer_block_costs(
        num_layers=4,
        hidden=512,
        num_heads=8,
        seq_len=256,
        vocab_size=1000,
        layout=ParallelPlan(tp=2),
        dropout=0.1,
    )
    stage = stage_costs(blocks, [0, 3, 6])[0]
    assert [b.name for b in stage.blocks] == ["embedding", "layer0", "layer1"]
    none, full = stage.saved_bytes("none"), stage.saved_bytes("full")
    assert full < stage.saved_bytes("selective") < none
    assert stage.transient_bytes("none") == 0
    assert stage.transient_bytes("full") == pytest.approx(
        blocks[1].saved_bytes - blocks[1].saved_for("full")
    )
    device = Device(name="d", peak_flops={"bf16": 1e12}, memory_bytes=1)
    link = Link(latency_s=1e-6, bandwidth_Bps=1e10)
    links = AxisLinks({"tp": 2}, {"tp": link})
    plain = stage.times(device, "bf16", links=links)
    redo = stage.times(device, "bf16", recompute="full", links=links)
    assert redo.backward_input_s == pytest.approx(
        plain.backward_input_s + plain.forward_s
    )  # the forward (and its collectives) again
    assert plain.comm_forward_s > 0
    with pytest.raises(ValueError, match="boundaries"):
        stage_costs(blocks, [0, 3, 3, 6])
    with pytest.raises(ValueError, match="recompute='some'"):
        stage.times(device, "bf16", recompute="some")  # type: ignore[arg-type]


def test_a_gpts_layers_are_one_priced_layer_under_their_names() -> None:
    """The layers are priced once and copied under their names: each equals the first
    built anew (checked by the dataclass's own constructor) with its own name."""
    blocks = transformer_block_costs(num_layers=6, hidden=256, num_heads=8, seq_len=128,
                                     vocab_size=1000, micro_batch_size=2,
                                     layout=ParallelPlan(tp=2, sequence_parallel=True))  # fmt: skip
    layers = blocks[1:-1]
    assert [b.name for b in layers] == [f"layer{i}" for i in range(6)]
    assert all(b == dataclasses.replace(layers[0], name=b.name) for b in layers)
    assert layers[3].forward_flops > 0 and layers[3].saved_bytes > 0
