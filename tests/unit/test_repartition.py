"""Re-partitioning's policy without processes: the split it proposes from measured stage
times, and the layouts it refuses."""

from __future__ import annotations

import itertools

import pytest

from plait.config import ParallelPlan, TrainConfig
from plait.train.repartition import Repartitioner


def _best_split(costs: list[float], speeds: list[float]) -> float:
    """The fastest bottleneck of any contiguous split (brute force)."""
    n, k, best = len(costs), len(speeds), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        spans = zip(bounds, bounds[1:], speeds, strict=False)
        worst = max(sum(costs[a:b]) / s for a, b, s in spans)
        best = min(best, worst)
    return best


def test_proposal_gives_a_slowed_rank_fewer_blocks_and_is_optimal() -> None:
    costs = [1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.5]
    mover = Repartitioner(model=None, build=None, block_costs=costs)  # type: ignore[arg-type]
    sizes = (4, 4)
    # rank 1 became half as fast: its 7.5 units of blocks took 15 s, rank 0's 7 took 7 s
    proposed = mover.proposal(sizes, [7.0, 15.0])
    assert proposed[1] < sizes[1] and sum(proposed) == len(costs)
    a = proposed[0]
    got = max(sum(costs[:a]) / 1.0, sum(costs[a:]) / 0.5)
    assert got == pytest.approx(_best_split(costs, [1.0, 0.5]))


def test_repartition_refuses_layouts_it_cannot_move() -> None:
    for parallel, what in (
        (ParallelPlan(dp=2, pp=1), "pp=1, dp=2"),
        (ParallelPlan(dp=2, pp=2), "dp=2"),
        (ParallelPlan(pp=2, schedule="pipedream", microbatches=4), "schedule='pipedream'"),
    ):
        with pytest.raises(ValueError, match=what):
            TrainConfig(parallel=parallel, repartition="auto", batch_size=8)
    with pytest.raises(ValueError, match="repartition_threshold=0"):
        TrainConfig(repartition_threshold=0.0)
    TrainConfig(parallel=ParallelPlan(pp=2), repartition="auto")
