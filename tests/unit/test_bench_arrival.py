"""`plait bench arrival`'s statistics against hand computation: each call charged the
least time over the ranks, the warm-up calls dropped, and `slow_fraction` counted against
four times the back-to-back median of the same size."""

from __future__ import annotations

import math

import pytest

from plait.bench.arrival import PATTERNS, ArrivalConfig, summarise


def test_summary_is_the_least_over_ranks_after_warmup() -> None:
    config = ArrivalConfig(workers=2, sizes_kib=(8,), num_calls=5, num_warmup=1)
    # per pattern: rank 0's and rank 1's seconds of 6 calls (the first is warm-up)
    ranks = {
        "back-to-back": ([9.0, 1.0, 2.0, 1.0, 3.0, 1.0], [9.0, 2.0, 1.0, 1.0, 1.0, 2.0]),
        "together": ([9.0, 5.0, 4.0, 2.0, 9.0, 1.0], [9.0, 6.0, 3.0, 7.0, 8.0, 1.0]),
    }
    per_rank = [{p: {"8": list(ranks.get(p, ranks["back-to-back"])[r])} for p in PATTERNS}
                for r in range(2)]  # fmt: skip
    got = summarise(per_rank, config)
    # least over the two ranks, call by call, without the first call
    base = [1.0, 1.0, 1.0, 1.0, 1.0]  # back-to-back: median 1
    together = [5.0, 3.0, 2.0, 8.0, 1.0]
    assert got["back-to-back"]["8"]["samples_s"] == base
    t = got["together"]["8"]
    assert t["samples_s"] == together
    assert t["median_s"] == 3.0 and t["max_s"] == 8.0
    assert t["mean_s"] == pytest.approx(19.0 / 5)
    assert t["p90_s"] == 8.0  # the 90th percentile of five sorted values: the fifth
    assert t["slow_fraction"] == pytest.approx(2 / 5)  # 5 and 8 exceed 4 × 1
    assert got["back-to-back"]["8"]["slow_fraction"] == 0.0


@pytest.mark.parametrize(
    "field",
    [{"workers": 1}, {"sizes_kib": ()}, {"sizes_kib": (0,)}, {"compute_ms": -1.0},
     {"jitter_ms": math.nan}, {"late_ms": math.inf}, {"num_calls": 0}, {"num_warmup": -1}],
)  # fmt: skip
def test_bad_config_is_refused(field: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ArrivalConfig(**field)  # type: ignore[arg-type]
