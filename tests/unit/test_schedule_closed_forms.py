"""Unit-cost replays against the closed forms of the papers each generator cites."""

from __future__ import annotations

import pytest

from plait.schedule import build, replay, validate

T_F, T_B = 1.0, 2.0  # replay's default unit durations: forward 1, whole backward 2
GRID = [(p, m) for p in range(1, 6) for m in range(1, 11)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_rounds(kind: str) -> None:
    for p, m in GRID:
        result = replay(build(kind, p, m))
        assert result.makespan == (m + p - 1) * (T_F + T_B), (kind, p, m)
        for rank in range(p):
            assert result.busy(rank) == m * (T_F + T_B)


def test_interleaved_bubble_when_p_divides_m() -> None:
    for p in range(1, 6):
        for m in (p, 2 * p, 3 * p):
            for v in (2, 3, 4):
                report = validate(build("interleaved", p, m, v))
                assert report.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
                assert report.makespan == (v * m + p - 1) * (T_F + T_B)


def test_interleaving_shrinks_the_bubble_of_1f1b() -> None:
    for p, m in [(2, 4), (4, 8), (4, 12), (3, 9)]:
        plain = validate(build("1f1b", p, m)).bubble_fraction
        assert validate(build("interleaved", p, m, 2)).bubble_fraction < plain


def test_1f1b_bounds_rank_0_memory_by_p_and_gpipe_holds_every_microbatch() -> None:
    for p, m in GRID:
        one_f_one_b = replay(build("1f1b", p, m)).peak_inflight
        assert one_f_one_b[0] == min(p, m)
        assert one_f_one_b == tuple(min(p - r, m) for r in range(p))
        assert replay(build("gpipe", p, m)).peak_inflight == (m,) * p


def test_zb_h1_reaches_the_papers_makespan() -> None:
    """Qi et al. (ICLR 2024), ZB-H1 with t_F = t_BI = t_BW = 1: 3m + p - 1 once m >= p,
    i.e. a bubble of (p - 1)(t_F + t_BI - t_BW); with fewer micro-batches 2m + 2p - 1."""
    for p in range(1, 9):
        for m in range(1, 3 * p + 3):
            result = replay(build("zb-h1", p, m))
            expected = 3 * m + p - 1 if m >= p else 2 * m + 2 * p - 1
            assert result.makespan == expected, (p, m)
            assert result.peak_inflight == (min(p, m),) * p, (p, m)


def test_zb_h1_beats_1f1b_without_more_memory() -> None:
    for p, m in GRID:
        if p < 2 or m < 2:
            continue
        zb, base = replay(build("zb-h1", p, m)), replay(build("1f1b", p, m))
        assert zb.makespan < base.makespan, (p, m)
        assert max(zb.peak_inflight) <= max(base.peak_inflight), (p, m)


def test_replay_of_64_ranks_and_512_microbatches() -> None:
    """The largest 1F1B the simulator replays inside its search loop; how long build and
    replay take is `plait bench scale`'s (CPU-time bounds here failed on loaded machines)."""
    p, m = 64, 512
    result = replay(build("1f1b", p, m))
    assert result.makespan == (m + p - 1) * (T_F + T_B)
    assert result.peak_inflight[0] == p
