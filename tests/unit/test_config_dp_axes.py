"""dp_replicate and dp_shard: the data-parallel axes of a plan, and the old zero values as
names for their common cases."""

from __future__ import annotations

import pytest

from plait.config import ParallelPlan


def _axes(plan: ParallelPlan) -> tuple[int, int, int, int]:
    layout = plan.layout
    return plan.dp, layout.dp_replicate, layout.dp_shard, plan.zero


def test_old_zero_values_name_the_common_cases() -> None:
    assert _axes(ParallelPlan(dp=4, pp=1)) == (4, 4, 1, 0)
    assert _axes(ParallelPlan(dp=4, pp=1, zero=1)) == (4, 4, 1, 1)
    assert _axes(ParallelPlan(dp=4, pp=1, zero=2)) == (4, 4, 1, 2)
    assert _axes(ParallelPlan(dp=4, pp=1, zero=3)) == (4, 1, 4, 3)


def test_given_axes_fix_dp_and_the_other_axis() -> None:
    assert _axes(ParallelPlan(dp_replicate=2, dp_shard=2, pp=1)) == (4, 2, 2, 3)
    assert _axes(ParallelPlan(dp=4, dp_replicate=2, pp=1, zero=3)) == (4, 2, 2, 3)
    assert _axes(ParallelPlan(dp=8, dp_shard=2, pp=1)) == (8, 4, 2, 3)
    assert _axes(ParallelPlan(dp_replicate=2, dp_shard=2, pp=1, zero=2)) == (4, 2, 2, 2)
    assert _axes(ParallelPlan(dp_replicate=3, pp=1)) == (3, 3, 1, 0)
    hsdp = ParallelPlan(dp_replicate=2, dp_shard=2, pp=1)
    assert hsdp.world_size == 4 and hsdp.dp_group(0) == [0, 1, 2, 3]
    assert hsdp.layout.ranks("dp_shard", 2) == [2, 3]
    assert hsdp.layout.ranks("dp_replicate", 1) == [1, 3]


def test_plans_without_the_axes_serialise_as_before() -> None:
    assert "dp_replicate" not in ParallelPlan(dp=2, pp=1).to_dict()
    given = ParallelPlan(dp_replicate=2, dp_shard=2, pp=1).to_dict()
    assert (given["dp"], given["dp_replicate"], given["dp_shard"]) == (4, 2, 2)
    assert ParallelPlan(**given) == ParallelPlan(dp_replicate=2, dp_shard=2, pp=1)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dp": 6, "dp_replicate": 4}, r"dp=6 is not a multiple of dp_replicate × dp_shard"),
        ({"dp": 8, "dp_replicate": 2, "dp_shard": 2}, r"dp=8 but dp_replicate × dp_shard"),
        ({"dp_replicate": 2, "dp_shard": 2, "zero": 1}, r"zero=1 with dp_replicate=2"),
        ({"dp_replicate": 4, "zero": 3}, r"zero=3 with dp_shard=1 shards over nothing"),
        ({"dp_shard": 0}, r"dp_shard=0 must be a positive integer"),
    ],
)
def test_inconsistent_axes_are_refused_with_the_fix(values: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelPlan(pp=1, **values)
