"""A measured model's sharded blocks under tensor parallelism (`scaled_spec`): without
measured shares, work divides by tp and two all-reduces of the block's output are added
a pass; with shares measured at (tp, sequence parallelism), the block costs those shares
of its whole time at that micro-batch size (linear between the measured sizes, the
nearest two beyond), with no collective added. The expected blocks are written out here."""

from __future__ import annotations

import pytest

from plait.cost import BlockCost
from plait.plan import ModelSpec, scaled_spec
from plait.sim import SimPlan

F1, BI1, BW1 = 3.0e9, 4.0e9, 5.0e9  # FLOPs of each pass at micro-batch size 1
F8, BI8, BW8 = 10.0e9, 18.0e9, 26.0e9  # and at 8


def _block(name: str, f: float, bi: float, bw: float) -> BlockCost:
    return BlockCost(name=name, forward_flops=f, backward_input_flops=bi,
                     backward_weight_flops=bw, activation_bytes=1e6, saved_bytes=2e6,
                     num_params=1000)  # fmt: skip


MEASURED = {
    1: [_block("embedding", 1e9, 1e9, 1e9), _block("layer", F1, BI1, BW1)],
    8: [_block("embedding", 8e9, 8e9, 8e9), _block("layer", F8, BI8, BW8)],
}
# (forward, backward, input half, weight half); a full backward reads only the first two
SHARES = {(2, False): {1: (6.0, 4.0, 4.0, 4.0), 8: (2.0, 1.5, 1.5, 1.5)}}


def _spec(
    shares: dict[tuple[int, bool], dict[int, tuple[float, float, float, float]]] | None,
) -> ModelSpec:
    return scaled_spec("m", MEASURED, seq_len=64, num_heads=4, tp_blocks=[1], tp_ratios=shares)


def _through(v1: float, v8: float, b: int) -> float:
    """The line through (1, v1) and (8, v8) at b."""
    return v1 + (v8 - v1) * (b - 1) / 7


@pytest.mark.parametrize("b", [1, 4, 8, 16])
def test_measured_shares_replace_the_division_and_the_all_reduces(b: int) -> None:
    layer = _spec(SHARES).blocks(b, SimPlan(tp=2))[1]
    # the sharded times measured at 1 and 8 (share × whole), and the line through them
    assert layer.forward_flops == pytest.approx(_through(6.0 * F1, 2.0 * F8, b), rel=1e-12)
    assert layer.backward_input_flops == pytest.approx(_through(4.0 * BI1, 1.5 * BI8, b), rel=1e-12)
    assert layer.backward_weight_flops == pytest.approx(
        _through(4.0 * BW1, 1.5 * BW8, b), rel=1e-12
    )
    assert layer.forward_comm == () and layer.backward_comm == ()
    # memory still divides: each rank holds its share of the weights and activations
    whole = _spec(None).blocks(b, SimPlan())[1]
    assert layer.num_params == 500 and layer.saved_bytes == pytest.approx(whole.saved_bytes / 2)
    # the block that does not shard is computed whole on every rank, as without shares
    assert _spec(SHARES).blocks(b, SimPlan(tp=2))[0] == _spec(None).blocks(b, SimPlan(tp=2))[0]


def test_unmeasured_degrees_and_sequence_parallelism_divide_as_before() -> None:
    for layout in (SimPlan(tp=4), SimPlan(tp=2, sequence_parallel=True)):
        measured = _spec(SHARES).blocks(8, layout)[1]
        analytic = _spec(None).blocks(8, layout)[1]
        assert measured == analytic
        tp = layout.tp
        assert measured.forward_flops == pytest.approx(F8 / tp)
        assert measured.backward_weight_flops == pytest.approx(BW8 / tp)
        assert [c.kind for c in measured.forward_comm] == ["all_reduce"] * 2


def test_one_measured_size_holds_at_every_size() -> None:
    one = {(2, False): {4: (3.0, 2.5, 2.5, 2.5)}}
    for b in (1, 4, 8):
        layer = _spec(one).blocks(b, SimPlan(tp=2))[1]
        whole = _spec(None).blocks(b, SimPlan())[1]
        assert layer.forward_flops == pytest.approx(whole.forward_flops * 3.0)
        assert layer.backward_input_flops == pytest.approx(whole.backward_input_flops * 2.5)


# a third size, where the time bends: 8 → 16 costs far more a sample than 1 → 8
F16 = 40.0e9
BENT = {**MEASURED, 16: [_block("embedding", 16e9, 16e9, 16e9), _block("layer", F16, BI8 * 2,
                                                                       BW8 * 2)]}  # fmt: skip


@pytest.mark.parametrize("b", [1, 2, 8, 12, 16, 32])
def test_between_measured_sizes_the_two_around_price_a_block(b: int) -> None:
    spec = scaled_spec("m", BENT, seq_len=64, num_heads=4, tp_blocks=[1])
    layer = spec.blocks(b, SimPlan())[1]
    # up to 8 the line through the times at 1 and 8, from 8 on the one through 8 and 16
    expected = _through(F1, F8, b) if b <= 8 else F8 + (F16 - F8) * (b - 8) / 8
    assert layer.forward_flops == pytest.approx(expected, rel=1e-12)


def test_sharded_times_bend_with_the_measured_sizes() -> None:
    shares = {
        (2, False): {1: (6.0, 4.0, 4.0, 4.0), 8: (2.0, 1.5, 1.5, 1.5), 16: (1.0, 1.0, 1.0, 1.0)}
    }
    spec = scaled_spec("m", BENT, seq_len=64, num_heads=4, tp_blocks=[1], tp_ratios=shares)
    for b in (4, 12, 32):
        at = (6.0 * F1, 2.0 * F8) if b <= 8 else (2.0 * F8, 1.0 * F16)
        left, right = (1, 8) if b <= 8 else (8, 16)
        expected = at[0] + (at[1] - at[0]) * (b - left) / (right - left)
        layer = spec.blocks(b, SimPlan(tp=2))[1]
        assert layer.forward_flops == pytest.approx(expected, rel=1e-12), b


def test_the_planner_measures_up_to_the_largest_micro_batch_a_plan_may_take() -> None:
    from plait.train.planinputs import profile_sizes

    # one sample, a worker's share (16 / 4), the largest size of the space dividing 16
    assert profile_sizes(16, 4) == [1, 4, 16]
    assert profile_sizes(16, 4, largest=8) == [1, 4, 8]
    assert profile_sizes(96, 4) == [1, 24, 32]  # the space's sizes stop at 32
    assert profile_sizes(6, 4) == [1, 2]  # of 1, 2, 4, ..., 32 only 1 and 2 divide 6
    assert profile_sizes(3, 4) == [1]


# the split backward's halves measured apart: (forward, backward, input half, weight half)
SPLIT_SHARES = {(2, False): {1: (6.0, 4.0, 7.0, 2.0), 8: (2.0, 1.5, 3.0, 1.25)}}
SPLIT1 = {
    1: [_block("embedding", 1e9, 1e9, 1e9), _block("layer", F1, 1.5 * BI1, 0.75 * BW1)],
    8: [_block("embedding", 8e9, 8e9, 8e9), _block("layer", F8, 1.5 * BI8, 0.75 * BW8)],
}


@pytest.mark.parametrize("b", [1, 4, 8])
def test_a_split_backward_takes_its_halves_own_measured_shares(b: int) -> None:
    from plait.sim import SimPlan as Plan

    spec = scaled_spec("m", MEASURED, seq_len=64, num_heads=4, tp_blocks=[1],
                       measured_split=SPLIT1, tp_ratios=SPLIT_SHARES)  # fmt: skip
    split = spec.blocks_for(Plan(tp=2, schedule="zb-h1", pp=2, microbatches=4, micro_batch_size=b))
    layer = split[1]
    # the split's own measured halves (1.5 BI, 0.75 BW of the full one's), each times its share
    assert layer.backward_input_flops == pytest.approx(
        _through(7.0 * 1.5 * BI1, 3.0 * 1.5 * BI8, b), rel=1e-12
    )
    assert layer.backward_weight_flops == pytest.approx(
        _through(2.0 * 0.75 * BW1, 1.25 * 0.75 * BW8, b), rel=1e-12
    )
    # a full backward (1F1B) keeps the backward's share for both halves
    full = spec.blocks_for(Plan(tp=2, schedule="1f1b", pp=2, microbatches=4, micro_batch_size=b))
    assert full[1].backward_input_flops == pytest.approx(_through(4.0 * BI1, 1.5 * BI8, b))
    assert full[1].backward_weight_flops == pytest.approx(_through(4.0 * BW1, 1.5 * BW8, b))


def test_profiled_seconds_reads_a_measured_spec_back_in_seconds() -> None:
    from plait.train.planinputs import profiled_seconds

    # measured specs hold seconds as FLOPs at 1e9 FLOP/s; a block of 2 ms forward, 1.5 ms
    # backward for the input and 0.5 ms for the weights per sample, three of them
    def costs(b: int, layout: object) -> list[BlockCost]:
        return [_block(f"b{i}", 2e6 * b, 1.5e6 * b, 0.5e6 * b) for i in range(3)]

    spec = ModelSpec(name="m", num_blocks=3, seq_len=8, num_heads=1, costs=costs)
    assert profiled_seconds(spec, 4) == pytest.approx(3 * 4 * 4e-3, rel=1e-12)
