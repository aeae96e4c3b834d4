"""The mesh of a layout: degrees must fill the workers, tensor parallelism stay in a node."""

from __future__ import annotations

import pytest

from plait.layout import Layout
from plait.mesh import check_fits


def test_every_factorisation_of_the_world_is_accepted() -> None:
    for dp, tp, pp in [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (4, 2, 1), (2, 4, 1)]:
        check_fits(Layout(dp_replicate=dp, tp=tp, pp=pp), 8, local_world_size=8)


def test_degrees_that_do_not_fill_the_workers_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"holds 4 ranks \(dp_replicate=2 × tp=2\), not the 8 workers"
    ):
        check_fits(Layout(dp_replicate=2, tp=2, pp=1), 8)


def test_tensor_parallelism_must_stay_inside_a_node() -> None:
    with pytest.raises(ValueError, match="tp=8 does not divide the 4 workers of a node"):
        check_fits(Layout(dp_replicate=1, tp=8, pp=1), 8, local_world_size=4)
    check_fits(Layout(dp_replicate=2, tp=4, pp=1), 8, local_world_size=4)  # one tp group per node


def test_degrees_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pp=0 must be a positive integer"):
        Layout(dp_replicate=1, tp=1, pp=0)
