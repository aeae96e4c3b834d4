"""Context parallelism in the cost model and the simulator, against formulas written here:
per-rank work and activations fall as 1/cp, each layer's forward ring sends
2·(cp−1)·b·s/cp·h fp32 elements, only the transfer time attention does not cover is
charged, and gradients are reduced over dp × cp."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.cli.main import main
from plait.cluster import Device, Link
from plait.cost import AxisLinks, StageCost, layer_activation_bytes, sync_degrees
from plait.cost.transformer import TransformerShape, transformer_block_costs
from plait.sim import SimPlan

L, H, A, S, V, B = 2, 256, 8, 1024, 1000, 2


def _blocks(cp: int, tp: int = 1, dtype: str = "fp32") -> list[Any]:
    plan = SimPlan(cp=cp, tp=tp, seq_len=S, dtype=dtype)
    return transformer_block_costs(num_layers=L, hidden=H, num_heads=A, seq_len=S, vocab_size=V,
                                   micro_batch_size=B, dtype=dtype, layout=plan)  # fmt: skip


def _shape(cp: int, dtype: str = "fp32") -> TransformerShape:
    plan = SimPlan(cp=cp, seq_len=S)
    return TransformerShape(num_layers=L, hidden=H, num_heads=A, seq_len=S, vocab_size=V,
                            micro_batch_size=B, dtype=dtype, layout=plan)  # fmt: skip


def _layer_bytes_by_hand(s: int, w: int, *, ring: bool) -> float:
    """plait's GPT layer without dropout, per rank holding s tokens of each sequence: norms'
    inputs and outputs (4), q, k, v and the attention output (4), the MLP's 4h up output
    and GeLU's (8), all b·s·h; the norms' mean and rstd (4·b·s); the core's lse (4·a·b·s
    bytes). The fp32 ring keeps q, k, v and its output in fp32 besides the projection's
    input."""
    sbh = s * B * H
    core = 3 * max(w, 4) + 4 + w if ring else 4 * w
    return sbh * (4 * w + core + 8 * w) + 4 * s * B * w + 4 * A * s * B


@pytest.mark.parametrize("cp", [2, 4])
def test_activation_bytes_per_rank_follow_the_local_sequence(cp: int) -> None:
    for dtype, w in (("fp32", 4), ("bf16", 2)):
        one, split = _shape(1, dtype), _shape(cp, dtype)
        assert layer_activation_bytes(one, "none") == _layer_bytes_by_hand(S, w, ring=False)
        assert layer_activation_bytes(split, "none") == _layer_bytes_by_hand(S // cp, w, ring=True)
        # recomputation keeps no ring copies: exactly 1/cp
        for mode in ("selective", "full"):
            assert layer_activation_bytes(split, mode) == layer_activation_bytes(one, mode) / cp
    fp32 = layer_activation_bytes(_shape(2), "none") / layer_activation_bytes(_shape(1), "none")
    assert fp32 <= 0.6


def test_flops_per_rank_fall_as_one_over_cp() -> None:
    one, two = _blocks(1), _blocks(2)
    for a, b in zip(one, two, strict=True):
        assert b.forward_flops == pytest.approx(a.forward_flops / 2)
        assert b.backward_input_flops == pytest.approx(a.backward_input_flops / 2)
        assert b.num_params == a.num_params  # the weights are replicated over cp
    attention = 4 * B * S * S * H / 2  # 4·b·s²·h of the layer, half on each rank
    assert two[1].forward_flops == pytest.approx((24 * B * S * H * H) / 2 + attention)


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (4, 1), (2, 2)])
def test_ring_bytes_per_layer(cp: int, tp: int) -> None:
    layer = _blocks(cp, tp)[1]
    assert layer.ring is not None
    assert layer.ring.forward_bytes == 2 * (cp - 1) * B * S // cp * H // tp * 4
    # backward: K, V again, and dK, dV around the whole ring
    assert layer.ring.backward_bytes == (2 * (cp - 1) + 2 * cp) * B * S // cp * H // tp * 4
    assert _blocks(1)[1].ring is None


def _times(cp: int, link: Link, recompute: str = "none") -> Any:
    device = Device(name="d", peak_flops={"fp32": 1e12}, efficiency=1.0, memory_bytes=1 << 40)
    layer = StageCost((_blocks(cp)[1],))
    links = AxisLinks({"cp": cp}, {"cp": link})
    return layer.times(device, "fp32", links=links, recompute=recompute), layer


def test_only_the_transfer_attention_does_not_cover_is_charged() -> None:
    cp, rate = 4, 1e12
    block = B * S // cp * H * 4  # one K or V block, fp32
    attention = 4 * B * (S // cp) * S * H  # the rank's attention FLOPs (one layer forward)
    slow = Link(latency_s=1e-3, bandwidth_Bps=1e6)
    t, layer = _times(cp, slow)
    fwd_step = 1e-3 + 2 * block / 1e6
    bwd_step = 1e-3 + 4 * block / 1e6
    home = 1e-3 + 2 * block / 1e6
    exposed_f = (cp - 1) * (fwd_step - attention / cp / rate)
    exposed_b = (cp - 1) * (bwd_step - 2 * attention / cp / rate) + home
    assert t.forward_s == pytest.approx(layer.forward_flops / rate + exposed_f)
    assert t.backward_input_s == pytest.approx(layer.backward_input_flops / rate + exposed_b)
    assert t.cp_comm_s == pytest.approx(exposed_f + exposed_b)
    full, _ = _times(cp, slow, "full")  # recomputation runs the forward ring again
    assert full.cp_comm_s == pytest.approx(2 * exposed_f + exposed_b)
    fast, _ = _times(cp, Link(latency_s=0.0, bandwidth_Bps=1e18))
    assert fast.forward_s == pytest.approx(layer.forward_flops / rate)


def test_gradients_reduce_over_dp_times_cp() -> None:
    plan = SimPlan(dp=2, cp=2, zero=1, seq_len=S)
    assert sync_degrees(plan)["dp"] == 4


MODEL = ["--layers", "4", "--hidden", "1024", "--heads", "16", "--seq-len", "8192",
         "--vocab", "32000", "--cluster", "dgx-h100", "--tp", "8"]  # fmt: skip


def _simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["simulate", *MODEL, *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def test_simulate_cp_predicts_less_memory_and_time(capsys: pytest.CaptureFixture[str]) -> None:
    one, two = _simulate(capsys), _simulate(capsys, "--cp", "2")
    assert (one["cp"], two["cp"], two["plan"]["cp"]) == (1, 2, 2)
    assert "cp" not in one["plan"]
    act1, act2 = one["memory"][0]["activations"], two["memory"][0]["activations"]
    assert 0.45 < act2 / act1 <= 0.6
    for key in ("params", "optimizer"):  # the model state is replicated over cp
        assert two["memory"][0][key] == one["memory"][0][key]
    assert two["step_time_s"] < one["step_time_s"]
    assert two["ranks"][0]["dp_comm_s"] > 0 == one["ranks"][0]["dp_comm_s"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cp", "3"], "divisible by 2·cp = 6"),
        (["--cp", "2", "--pp", "2", "--schedule", "pipedream"], "synchronous"),
    ],
)
def test_simulate_cp_refusals(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["simulate", *MODEL, *argv]) == 2
    assert message in capsys.readouterr().err


def test_sequence_parallelism_splits_the_local_sequence_of_a_cp_rank() -> None:
    # 24 tokens divide by tp=8, but a cp=2 rank holds 12, which sequence parallelism
    # would cut into 8 parts
    def shape(cp: int, seq: int) -> TransformerShape:
        plan = SimPlan(cp=cp, tp=8, seq_len=seq, sequence_parallel=True)
        return TransformerShape(num_layers=1, hidden=64, num_heads=8, seq_len=seq,
                                vocab_size=V, layout=plan)  # fmt: skip

    assert shape(1, 24).local_seq == 24 and shape(2, 32).local_seq == 16
    with pytest.raises(ValueError, match=r"seq_len=24 over cp=2 leaves 12 tokens .* tp=8"):
        shape(2, 24)


def test_the_ring_with_dropout_keeps_its_bool_mask_not_s2_scores() -> None:
    def layer(cp: int, dropout: float) -> float:
        plan = SimPlan(cp=cp, seq_len=S)
        shape = TransformerShape(num_layers=L, hidden=H, num_heads=A, seq_len=S, vocab_size=V,
                                 micro_batch_size=B, dtype="bf16", layout=plan,
                                 dropout=dropout)  # fmt: skip
        return layer_activation_bytes(shape, "none")

    s = S // 2  # a cp=2 rank's tokens; CUDA's dropout masks: one byte per element
    residual_masks = 2 * s * B * H  # the two keyed dropouts of the layer
    ring_mask = A * s * S * B  # this rank's queries against all S keys
    assert layer(2, 0.1) - layer(2, 0.0) == residual_masks + ring_mask
    # one process materializes softmax, mask and dropped scores, a·S²·b·(2·2 + 1), in
    # place of the fused kernel's fp32 log-sum-exp
    assert layer(1, 0.1) - layer(1, 0.0) == 2 * S * B * H + A * S * S * B * 5 - 4 * A * S * B
