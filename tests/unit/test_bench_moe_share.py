"""`plait bench moe`'s predicted all-to-all share (`predict_share`, the simulator on the cost
model's MoE layer) against a closed form written here from the exchange the runtime does:
per step, E int64 counts and then the token copies there and back forward, the copies'
gradients there and back backward, each all-to-all n - 1 messages of latency alpha and
(n - 1)/n of its send buffer at the link's bandwidth; and it moves with every input."""

from __future__ import annotations

import pytest

from plait.bench.moe import MoEBenchConfig, predict_share


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
