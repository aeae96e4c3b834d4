"""Block costs take the layout: a rank's costs under a layout, checked by hand, depend on
its tp, sequence parallelism and ep alone, and the planner caches them by exactly those."""

from __future__ import annotations

import pytest

from plait.config import ParallelPlan
from plait.cost import BlockCost, Layout, MoEShape, moe_block_costs, transformer_block_costs
from plait.plan import ModelSpec, gpt_spec
from plait.sim import SimPlan

H, HEADS, S, B, V, LAYERS = 64, 4, 32, 2, 96, 2
F, WIDTH, TOKENS = 4 * H, 2, B * S  # bf16


def _gpt(layout: Layout, micro_batch_size: int = B) -> list[BlockCost]:
    return transformer_block_costs(num_layers=LAYERS, hidden=H, num_heads=HEADS, seq_len=S,
                                   vocab_size=V, micro_batch_size=micro_batch_size,
                                   dtype="bf16", layout=layout)  # fmt: skip


def _moe(moe: MoEShape, layout: Layout) -> list[BlockCost]:
    return moe_block_costs(num_layers=LAYERS, hidden=H, num_heads=HEADS, seq_len=S,
                           vocab_size=V, moe=moe, micro_batch_size=B, dtype="bf16",
                           layout=layout)  # fmt: skip


def test_tp2_sequence_parallel_rank_by_hand() -> None:
    """tp = 2 with sequence parallelism (Megatron-LM; Korthikanti et al. 2022): the GEMMs'
    weights and FLOPs halve, norms and row-parallel biases stay whole, every activation
    kept is a half, and each layer pass all-gathers and reduce-scatters b·s·h twice."""
    t = 2
    embedding, *layers, head = _gpt(ParallelPlan(tp=t, sequence_parallel=True))
    # QKV (3h·h + 3h), projection (h·h), fc1 (f·h + f) and fc2 (h·f) split over the ranks;
    # the projection's and fc2's biases (h each) and two layer norms (2 × 2h) replicated
    sharded = 3 * H * H + 3 * H + H * H + F * H + F + H * F
    assert [x.num_params for x in layers] == [sharded // t + 2 * H + 4 * H] * LAYERS
    assert embedding.num_params == V * H // t + S * H  # vocabulary split, positions whole
    assert head.num_params == V * H // t + 2 * H  # the LM head split, the final norm whole
    layer = layers[0]
    # Narayanan et al. 2021 for f = 4h: 24·b·s·h² + 4·b·s²·h per layer, over t ranks
    assert layer.forward_flops == pytest.approx((24 * TOKENS * H * H + 4 * TOKENS * S * H) / t)
    assert layer.activation_bytes == TOKENS * H * WIDTH / t  # the layer's output, a slice
    # no dropout: 16 b·s·h activations, the norms' 4·b·s statistics and an fp32 log-sum-exp
    # (4·a·s·b bytes), every one of them split by sequence or by heads
    kept = WIDTH * (16 * TOKENS * H + 4 * TOKENS) + 4 * HEADS * TOKENS
    assert layer.saved_bytes == pytest.approx(kept / t)
    pair = [("all_gather", "tp", TOKENS * H * WIDTH), ("reduce_scatter", "tp", TOKENS * H * WIDTH)]
    for comm in (layer.forward_comm, layer.backward_comm):
        assert [(c.kind, c.axis, c.num_bytes) for c in comm] == pair * 2


def test_moe_ep2_rank_by_hand() -> None:
    """ep = 2 over dp = 2: a rank holds half of each MoE layer's experts and everything
    else whole; each MoE layer exchanges the expert counts and its tokens by all-to-all
    over the ep group (GShard, Lepikhin et al. 2020)."""
    e, k, ep = 4, 2, 2
    moe = MoEShape(num_experts=e, top_k=k, capacity_factor=1.25, moe_every=1)
    _, *layers, _ = _moe(moe, ParallelPlan(dp=2, ep=ep))
    one_expert = H * F + F + F * H + H  # two GEMMs and their biases
    for layer in layers:
        assert layer.expert_params == e // ep * one_expert
        # attention (4h² + 4h), two layer norms (4h), the router (h·E, no bias)
        assert layer.num_params == 4 * H * H + 4 * H + 4 * H + H * e + e // ep * one_expert
        counts, *tokens = layer.forward_comm
        assert (counts.kind, counts.axis, counts.num_bytes) == ("all_to_all", "ep", 8 * e)
        # dispatch and combine: every token copy's hidden vector (balanced: ρ = 1)
        for comm in (tokens, layer.backward_comm):
            assert [(c.kind, c.axis, c.num_bytes) for c in comm] == [
                ("all_to_all", "ep", TOKENS * k * H * WIDTH)
            ] * 2


@pytest.mark.parametrize(
    "layout",
    [
        SimPlan(dp=3, tp=2, pp=2, sequence_parallel=True, schedule="gpipe", zero=1),
        SimPlan(tp=2, sequence_parallel=True, recompute="full", microbatches=8, pp=4),
    ],
)
def test_only_the_degrees_of_a_layout_change_its_costs(layout: SimPlan) -> None:
    """Layouts that differ in anything but tp, sequence parallelism and ep cost the same."""
    assert _gpt(layout) == _gpt(ParallelPlan(tp=2, sequence_parallel=True))
    assert _gpt(layout) != _gpt(ParallelPlan(tp=2))


def test_model_spec_caches_by_micro_batch_and_degrees() -> None:
    """The planner's model asks for a rank's costs once per (micro-batch size, tp,
    sequence parallelism, ep, split backward), whatever else its plans vary."""
    calls: list[tuple[int, int, bool, int]] = []
    source = gpt_spec(num_layers=LAYERS, hidden=H, num_heads=HEADS, seq_len=S, vocab_size=V)

    def costs(b: int, layout: Layout) -> list[BlockCost]:
        calls.append((b, layout.tp, layout.sequence_parallel, layout.ep))
        return list(source.costs(b, layout))

    model = ModelSpec(name="gpt", num_blocks=LAYERS + 2, seq_len=S, num_heads=HEADS, costs=costs)
    base = SimPlan(dp=2, tp=2, pp=2, micro_batch_size=2, seq_len=S)
    same = SimPlan(dp=1, tp=2, pp=4, micro_batch_size=2, seq_len=S, recompute="full")
    first = model.blocks_for(base)
    assert model.blocks_for(same) is first and calls == [(2, 2, False, 1)]
    for other in (
        SimPlan(dp=2, tp=2, pp=2, micro_batch_size=4, seq_len=S),
        SimPlan(dp=2, tp=1, pp=2, micro_batch_size=2, seq_len=S),
        SimPlan(dp=2, tp=2, pp=2, micro_batch_size=2, seq_len=S, sequence_parallel=True),
        SimPlan(dp=2, tp=2, pp=2, micro_batch_size=2, seq_len=S, ep=2),
    ):
        assert model.blocks_for(other) is not first
    assert calls[1:] == [(4, 2, False, 1), (2, 1, False, 1), (2, 2, True, 1), (2, 2, False, 2)]
    assert first == tuple(_gpt(base, micro_batch_size=2))


def test_moe_costs_refuse_what_the_layout_cannot_give_them() -> None:
    moe = MoEShape(num_experts=4, moe_every=1)
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=4"):
        _moe(moe, SimPlan(dp=3, ep=3))
    with pytest.raises(ValueError, match="sequence_parallel for a MoE-GPT"):
        _moe(moe, SimPlan(tp=2, sequence_parallel=True))
