"""`plait bench single`'s two ways to interleave the variants time every variant once per
repeat, from the same first step."""

import pytest

from plait.bench.single import SingleBenchConfig, run_bench

_TINY = dict(num_layers=1, hidden=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32,
             num_steps=2, num_warmup=1, num_repeats=3, compile=False, device="cpu")  # fmt: skip


@pytest.mark.parametrize("interleave", ["step", "block"])
def test_each_variant_is_timed_once_per_repeat_from_the_same_first_loss(interleave: str) -> None:
    result = run_bench(SingleBenchConfig(interleave=interleave, **_TINY))  # type: ignore[arg-type]
    assert set(result.times_s) == {"plait", "plain", "plain_fused"}
    assert all(len(t) == 3 and min(t) > 0 for t in result.times_s.values())
    assert result.loss_match, result.losses


def test_an_unknown_way_to_interleave_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="interleave='round'"):
        SingleBenchConfig(interleave="round")
