"""The WSP replay against closed forms, and the planner's choice of D."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.plan.wsp import choose_staleness
from plait.sim.wsp import replay_wsp


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("exchange_s", [0.0, 0.5, 3.0, 7.0])
def test_the_pace_is_the_slowest_wave_or_the_exchange_spread_over_d_plus_1(
    staleness: int, exchange_s: float
) -> None:
    # the slowest worker waits for the exchange of wave c - D - 1, which ended
    # exchange_s after its own wave c - D - 1: a cycle of D + 1 waves and one exchange
    wave_s = [1.0, 2.0, 1.5]
    replay = replay_wsp(wave_s, staleness=staleness, waves=40, exchange_s=exchange_s)
    expected = max(2.0, (2.0 + exchange_s) / (staleness + 1))
    assert replay.seconds_per_wave == pytest.approx(expected)


def test_synchronous_waves_make_the_fast_worker_wait_for_the_slow_one() -> None:
    replay = replay_wsp([1.0, 3.0], staleness=0, waves=5, exchange_s=0.5)
    # each wave after the first: the fast one waits (3 - 1) + 0.5
    assert replay.waiting_s(0) == pytest.approx(4 * 2.5)
    assert replay.waiting_s(1) == pytest.approx(4 * 0.5)
    assert replay.makespan_s == pytest.approx(5 * 3.0 + 4 * 0.5)


def test_a_fast_worker_runs_exactly_d_waves_ahead() -> None:
    replay = replay_wsp([1.0, 4.0], staleness=2, waves=12, exchange_s=0.0)
    # wave c of the fast worker begins when the slow one ends wave c - 3
    for c in range(3, 12):
        assert replay.starts[0][c] == pytest.approx(max(replay.ends[0][c - 1],
                                                        replay.ends[1][c - 3]))  # fmt: skip


@pytest.mark.parametrize(
    ("exchange_s", "allowance", "chosen"),
    [(0.0, 3, 0), (0.5, 3, 1), (3.0, 3, 2), (3.0, 1, 1), (0.5, 0, 0)],
)
def test_the_planner_takes_the_least_staleness_that_reaches_the_best_pace(
    exchange_s: float, allowance: int, chosen: int
) -> None:
    choice = choose_staleness([1.0, 2.0], exchange_s=exchange_s, allowance=allowance,
                              weight_bytes=2**20)  # fmt: skip
    assert choice.staleness == chosen
    assert len(choice.seconds_per_wave) == allowance + 1
    assert f"D={chosen}" in choice.explanation.splitlines()[0]
    assert choice.extra_bytes[0] == 3 * 2**20  # snapshot + own update + reduction buffer


def test_bad_replays_are_refused() -> None:
    with pytest.raises(ValueError, match="staleness=-1"):
        replay_wsp([1.0], staleness=-1, waves=3)
    with pytest.raises(ValueError, match="allowance=-1"):
        choose_staleness([1.0], exchange_s=0.0, allowance=-1)


def test_plait_plan_chooses_d_within_the_allowance_into_the_plan_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait.bench.hetpipe_config import HetPipeBenchConfig
    from plait.cli.main import main
    from plait.plan.io import parallel_plan_of, read_plan

    cluster = tmp_path / "c.toml"
    cluster.write_text(HetPipeBenchConfig().cluster_toml())  # 2 workers 2× slower
    out = tmp_path / "plan.json"
    argv = ["plan", "--cluster", str(cluster), "--batch-size", "24", "--layers", "2",
            "--hidden", "64", "--heads", "2", "--seq-len", "32", "--dtype", "fp32",
            "--wsp-staleness", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "WSP: " in capsys.readouterr().out
    layout = parallel_plan_of(read_plan(out))
    assert layout.wsp_staleness is not None and 0 <= layout.wsp_staleness <= 2
    assert layout.pipelines is not None and layout.zero == 0
