"""`plait.profile.calibrate.message_s` on gloo workers: a collective that pairs the ranks,
times their posting of sends and receives between computations, and gives every rank the
same figure (the planner's cluster is built from it on rank 0, and a decision must not
depend on which rank measured); with an odd count the unpaired rank only takes part."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.dist


def _worker(world: int) -> float:
    from plait.mesh import init_worker
    from plait.profile.calibrate import message_s

    init_worker(device="cpu")
    return message_s(num_bytes=4096)


@pytest.mark.parametrize("world", [3])
def test_every_rank_gets_the_same_posting_time(world: int) -> None:
    from plait.train import launch

    found = launch(_worker, world, world)
    values = list(found.values())
    assert len(values) == world
    assert all(math.isfinite(v) and v > 0 for v in values), values
    assert all(v == values[0] for v in values), values
