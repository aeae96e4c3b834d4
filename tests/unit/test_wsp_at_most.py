"""WSP's "at most D" (`wsp_at_most`): at the start of each wave a worker takes in the
waves more than D behind (waiting for them) and then every later wave already reduced,
oldest first. Checked against an emulator of that rule over scripted completion times
(a fake all-reduce: the others push +10 per wave, the worker +1 per step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.config import ParallelPlan
from plait.train import wsp
from plait.train.wsp import WaveExchange

OTHERS = 10.0  # what the other workers' wave updates add up to, every wave


class _Buckets:
    def __init__(self) -> None:
        self.w = torch.zeros(1)
        self.buckets = [(None, (0,), [])]

    def __len__(self) -> int:
        return 1

    def flat(self, index: int) -> torch.Tensor:
        return self.w.clone()

    def add(self, index: int, flat: torch.Tensor) -> None:
        self.w += flat


class _Work:
    def __init__(self, clock: dict[str, int], done_at: int) -> None:
        self.clock, self.done_at = clock, done_at

    def is_completed(self) -> bool:
        return self.clock["wave"] >= self.done_at

    def wait(self) -> bool:
        return True


def _emulate(done_at: list[int], staleness: int, at_most: bool) -> tuple[list[int], list[float]]:
    """Per wave c (one step each): waves not taken in at its start, and the weight then."""
    taken, lags, weights = 0, [], []
    for c in range(len(done_at)):
        taken = max(taken, c - staleness)  # waves <= c - D - 1: waited for
        while at_most and taken < c and done_at[taken] <= c:
            taken += 1
        lags.append(c - taken)
        weights.append(c * 1.0 + taken * OTHERS)  # own steps, others' waves taken in
    return lags, weights


@pytest.mark.parametrize("at_most", [False, True])
@pytest.mark.parametrize("staleness", [0, 2])
def test_the_staleness_is_at_most_d_and_takes_in_what_is_reduced(
    staleness: int, at_most: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # wave c's reduction completes at the start of wave done_at[c] (> c), out of order too
    done_at = [1, 4, 3, 4, 9, 6, 7, 8, 9, 10, 11, 12]
    clock = {"wave": 0}
    pushed: list[int] = []

    def all_reduce(total: torch.Tensor, group: Any = None, async_op: bool = False) -> _Work:
        total += OTHERS  # the others' wave update joins this worker's
        pushed.append(len(pushed))
        return _Work(clock, done_at[pushed[-1]])

    monkeypatch.setattr(wsp.dist, "all_reduce", all_reduce)
    buckets = _Buckets()
    ex = WaveExchange(buckets, staleness=staleness, wave=1, at_most=at_most)  # type: ignore[arg-type]
    seen = []
    for c in range(len(done_at)):
        clock["wave"] = c
        ex.before_step()
        seen.append(float(buckets.w))
        buckets.w += 1.0  # this worker's own update
        ex.after_step()
    lags, weights = _emulate(done_at, staleness, at_most)
    assert ex.lags == lags and seen == weights
    assert max(ex.lags) <= staleness
    if not at_most:
        assert ex.lags == [min(c, staleness) for c in range(len(done_at))]
    elif staleness:
        assert min(ex.lags[1:]) < staleness  # it did take in waves early


def test_at_most_needs_a_staleness() -> None:
    with pytest.raises(ValueError, match="wsp_at_most"):
        ParallelPlan(dp=2, pp=1, wsp_at_most=True)
    assert ParallelPlan(dp=2, pp=1, wsp_staleness=1, wsp_at_most=True).wsp_at_most
