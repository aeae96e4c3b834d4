"""`plait bench moe`'s predicted all-to-all share (`predict_share`, the simulator on the cost
model's MoE layer) against a closed form written here from the exchange the runtime does:
per step, E int64 counts and then the token copies there and back forward, the copies'
gradients there and back backward, each all-to-all n - 1 messages of latency alpha and
(n - 1)/n of its send buffer at the link's bandwidth; and it moves with every input."""

from __future__ import annotations

import pytest

from plait.bench.moe_config import MoEBenchConfig
from plait.bench.moe_share import predict_share


def _closed_form(c: MoEBenchConfig, ep: int, compute_s: float, alpha: float, bw: float) -> float:
    width = 4 if c.dtype == "fp32" else 2  # the copies travel in the compute dtype

    def all_to_all(num_bytes: float) -> float:
        return (ep - 1) / ep * num_bytes / bw + (ep - 1) * alpha

    comm = 4 * all_to_all(c.tokens * c.top_k * c.hidden * width) + all_to_all(8 * c.num_experts)
    return comm / (compute_s + comm)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_predicted_share_is_the_exchange_over_compute_plus_exchange(dtype: str) -> None:
    c = MoEBenchConfig(workers=(1, 2, 4), tokens=64, hidden=32, ffn=48, num_experts=8,
                       dtype=dtype, peer=False)  # fmt: skip
    base = {"ep": 2, "compute_s": 0.05, "latency_s": 2e-4, "bandwidth_Bps": 1e9}
    cases = [base, {**base, "ep": 4}, {**base, "compute_s": 0.2}, {**base, "latency_s": 1e-3},
             {**base, "bandwidth_Bps": 1e7}]  # fmt: skip
    shares = []
    for case in cases:
        got = predict_share(c, **case)  # type: ignore[arg-type]
        want = _closed_form(c, case["ep"], case["compute_s"], case["latency_s"],
                            case["bandwidth_Bps"])  # fmt: skip
        assert got == pytest.approx(want, rel=1e-9)
        shares.append(got)
    two, four, slower_compute, slower_latency, narrower = shares
    assert four > two and slower_compute < two and slower_latency > two and narrower > two
    bigger = predict_share(MoEBenchConfig(**{**c.__dict__, "tokens": 256}), **base)  # type: ignore[arg-type]
    assert bigger > two  # more copies, more bytes, the same compute


def test_measured_share_and_per_call_figures_from_the_ranks_timings() -> None:
    """Two ranks, two timed steps of two collectives each (after one warm-up step): each
    collective charged the least time over the ranks, the share their sum over the
    slowest ranks' steps; skew is the most minus the least time of a collective."""
    from plait.bench.moe_share import Probe, all_to_all_share

    bench = MoEBenchConfig(workers=(2,), tokens=8, hidden=16, ffn=24, num_experts=4,
                           num_warmup=1, num_steps=2, peer=False)  # fmt: skip
    probes = [[1e-4 * (i + 1) for i in range(len(Probe.SIZES))]] * 2
    rank0 = {
        "all_to_all": [[9.0, 9.0], [1.0, 4.0], [2.0, 1.0]],
        "times": {"plait": [10.0, 20.0], "local": [5.0, 6.0]},
        "probes": probes,
    }
    rank1 = {
        "all_to_all": [[9.0, 9.0], [3.0, 2.0], [2.0, 5.0]],
        "times": {"plait": [12.0, 18.0], "local": [4.0, 7.0]},
        "probes": probes,
    }
    got = all_to_all_share([rank0, rank1], bench, ep=2)
    # least over ranks: step 1 (1, 2), step 2 (2, 1); slowest steps 12 and 20
    assert got["all_to_all_share_measured"] == pytest.approx((3 + 3) / (12 + 20))
    assert got["all_to_all_call_s"] == [1.5, 1.5]
    assert got["all_to_all_call_mean_s"] == [1.5, 1.5]
    # most minus least: step 1 (2, 2), step 2 (0, 4)
    assert got["all_to_all_call_skew_s"] == [1.0, 3.0]
    assert got["local_step_s"] == pytest.approx((5 + 7) / 2)
