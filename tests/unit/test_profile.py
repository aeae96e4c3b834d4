"""The profiler: one record per block with plausible times and bytes, the cache, calibration."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from plait.cluster import Link
from plait.models import GPT
from plait.profile import (
    BlockProfile,
    GPTSpec,
    fit_link,
    matmul_flops,
    measured_device,
    optimizer_bandwidth,
    profile_blocks,
    profile_model,
    threads,
)

SPEC = GPTSpec(num_layers=2, hidden=32, num_heads=2, seq_len=16, vocab_size=48)
BATCH = 2


def sample() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SPEC.vocab_size, (BATCH, SPEC.seq_len), generator=g)
    return ids, torch.randint(0, SPEC.vocab_size, (BATCH, SPEC.seq_len), generator=g)


def model() -> GPT:
    torch.manual_seed(0)
    built = SPEC.build()
    assert isinstance(built, GPT)
    return built


@pytest.fixture(scope="module")
def measured() -> list[BlockProfile]:
    ids, targets = sample()
    with threads(1):
        return profile_blocks(
            model().blocks(), ids, loss_fn=GPT.loss, target=targets, names=SPEC.block_names(),
            warmup=1, repeats=3,
        )  # fmt: skip


def test_one_record_per_block_with_positive_times(measured: list[BlockProfile]) -> None:
    assert [b.name for b in measured] == ["embedding", "layer0", "layer1", "head"]
    assert all(b.forward_s > 0 for b in measured)
    assert all(b.backward_s > 0 for b in measured)
    for layer in measured[1:3]:
        assert layer.backward_input_s > 0
        assert layer.backward_weight_s > 0
    # token ids carry no gradient: the embedding's whole backward is its weight gradient
    assert measured[0].backward_input_s == 0.0


def test_bytes_are_plausible(measured: list[BlockProfile]) -> None:
    hidden_state = BATCH * SPEC.seq_len * SPEC.hidden * 4  # fp32 [b, s, h]
    embedding, layer, _, head = measured
    assert embedding.input_bytes == BATCH * SPEC.seq_len * 8  # int64 ids
    assert embedding.activation_bytes == hidden_state
    assert layer.input_bytes == layer.activation_bytes == hidden_state
    assert head.activation_bytes == 4  # the fp32 loss
    # a layer keeps several hidden states (layer norms, q/k/v, MLP), far more than its input
    assert 4 * hidden_state < layer.saved_bytes < 100 * hidden_state
    for block in measured:
        cost = block.to_cost(measured_device(name="d", flops=1e9, memory_bytes=1 << 30), "fp32")
        assert cost.saved_for("full") < cost.saved_for("none")
        assert block.param_bytes == 4 * block.num_params
    assert sum(b.num_params for b in measured) == model().num_params()


def test_cost_round_trip_gives_the_seconds_back(measured: list[BlockProfile]) -> None:
    from plait.cost import StageCost

    device = measured_device(name="cpu", flops=5e10, memory_bytes=1 << 30)
    layer = measured[1]
    split = StageCost((layer.to_cost(device, "fp32", split=True),)).times(device, "fp32")
    assert split.forward_s == pytest.approx(layer.forward_s)
    assert split.backward_input_s == pytest.approx(layer.backward_input_s)
    assert split.backward_weight_s == pytest.approx(layer.backward_weight_s)
    # unsplit: the halves add up to the full backward, in the split's ratio
    whole = StageCost((layer.to_cost(device, "fp32"),)).times(device, "fp32")
    assert whole.backward_s == pytest.approx(layer.backward_s)
    ratio = layer.backward_input_s / (layer.backward_input_s + layer.backward_weight_s)
    assert whole.backward_input_s == pytest.approx(layer.backward_s * ratio)


def test_cache_hit_returns_the_same_and_is_fast(tmp_path: Path) -> None:
    ids, targets = sample()
    kwargs = dict(target=targets, loss_fn=GPT.loss, warmup=1, repeats=3, cache_dir=tmp_path)
    start = time.perf_counter()
    first = profile_model(model(), ids, **kwargs)  # type: ignore[arg-type]
    measure_s = time.perf_counter() - start
    start = time.perf_counter()
    again = profile_model(model(), ids, **kwargs)  # type: ignore[arg-type]
    hit_s = time.perf_counter() - start
    assert not first.cached and again.cached
    assert again.blocks == first.blocks
    assert hit_s < measure_s
    assert len(list(tmp_path.glob("*.json"))) == 1
    # another input shape is another measurement
    kwargs["target"] = targets[:1]
    other = profile_model(model(), ids[:1], **kwargs)  # type: ignore[arg-type]
    assert not other.cached
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_corrupt_cache_file_is_measured_again(tmp_path: Path) -> None:
    ids, targets = sample()
    kwargs = dict(target=targets, loss_fn=GPT.loss, warmup=0, repeats=1, cache_dir=tmp_path)
    profile_model(model(), ids, **kwargs)  # type: ignore[arg-type]
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    again = profile_model(model(), ids, **kwargs)  # type: ignore[arg-type]
    assert not again.cached and len(again.blocks) == 4


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="repeats=0"):
        profile_blocks(model().blocks(), sample()[0], repeats=0)
    with pytest.raises(ValueError, match="1 names for 4 blocks"):
        profile_blocks(model().blocks(), sample()[0], names=["a"])
    with pytest.raises(ValueError, match="hidden=30 is not divisible by num_heads=4"):
        GPTSpec(num_layers=1, hidden=30, num_heads=4, seq_len=8, vocab_size=8)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    true = Link(latency_s=3e-5, bandwidth_Bps=2e9)
    link = fit_link([(n, true.time(n)) for n in (1e3, 1e4, 1e5, 1e6)])
    assert link.latency_s == pytest.approx(3e-5, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError, match="at least two different sizes"):
        fit_link([(1e3, 1e-5), (1e3, 2e-5)])


def test_fit_link_gives_a_finite_link_where_noise_leaves_no_slope() -> None:
    # a shared host: the small message timed slower than the large one (no slope); the
    # link is then bounded by what the times say, the largest moved in its whole time
    link = fit_link([(256.0, 4e-4), (1e6, 3e-4)])
    assert link.bandwidth_Bps == pytest.approx(1e6 / 3e-4)
    assert link.latency_s == pytest.approx(4e-4 - 256 * 3e-4 / 1e6)
    # a slope, but a line through negative time at zero bytes: the latency is what the
    # smallest message's time leaves after its bytes at the fitted bandwidth
    samples = [(1e3, 5e-6), (1e4, 1e-5), (1e6, 2e-3)]
    link = fit_link(samples)
    assert math.isfinite(link.bandwidth_Bps) and link.latency_s > 0
    assert link.latency_s + 1e3 / link.bandwidth_Bps == pytest.approx(5e-6)


def test_calibration_numbers_are_positive_and_threads_restored() -> None:
    before = torch.get_num_threads()
    assert matmul_flops(size=64, repeats=2) > 1e6
    assert torch.get_num_threads() == before
    params = list(torch.nn.Linear(64, 64).parameters())
    assert optimizer_bandwidth(params, repeats=2) > 0
    assert all(p.grad is None for p in params)


def test_analytic_spec_names_blocks_like_the_measured_ones() -> None:
    costs = SPEC.block_costs(micro_batch_size=BATCH, dtype="fp32")
    assert [c.name for c in costs] == SPEC.block_names()
    assert SPEC.num_params() == model().num_params()
