"""The named-axis Layout against groups and ranks written out by hand."""

from __future__ import annotations

import itertools

import pytest

from plait.layout import AXES, RANK_ORDERS, Layout


def _set(*groups: tuple[int, ...]) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


def _groups(layout: Layout, axis: str) -> set[frozenset[int]]:
    return {frozenset(g) for g in layout.groups(axis)}


# pp = dp_replicate = dp_shard = 2 (tp = cp = 1), eight ranks, written out by hand
HAND = {
    "tp-dp-pp": {  # rank = shard + 2·replicate + 4·pp
        "dp_shard": _set((0, 1), (2, 3), (4, 5), (6, 7)),
        "dp_replicate": _set((0, 2), (1, 3), (4, 6), (5, 7)),
        "dp": _set((0, 1, 2, 3), (4, 5, 6, 7)),
        "pp": _set((0, 4), (1, 5), (2, 6), (3, 7)),
    },
    "tp-pp-dp": {  # rank = pp + 2·shard + 4·replicate
        "dp_shard": _set((0, 2), (1, 3), (4, 6), (5, 7)),
        "dp_replicate": _set((0, 4), (1, 5), (2, 6), (3, 7)),
        "dp": _set((0, 2, 4, 6), (1, 3, 5, 7)),
        "pp": _set((0, 1), (2, 3), (4, 5), (6, 7)),
    },
}


@pytest.mark.parametrize("order", sorted(HAND))
def test_groups_of_a_hsdp_pipeline_world_match_the_hand_enumeration(order: str) -> None:
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, rank_order=order)
    assert layout.size == 8 and layout.degree("dp") == 4
    for axis, expected in HAND[order].items():
        assert _groups(layout, axis) == expected, axis
    assert _groups(layout, "tp") == {frozenset({r}) for r in range(8)}


# strides of (pp, dp_replicate, dp_shard, tp) for degrees (2, 2, 3, 2), by hand per order
STRIDES = {
    "tp-dp-pp": {"tp": 1, "dp_shard": 2, "dp_replicate": 6, "pp": 12},
    "dp-tp-pp": {"dp_shard": 1, "dp_replicate": 3, "tp": 6, "pp": 12},
    "pp-tp-dp": {"pp": 1, "tp": 2, "dp_shard": 4, "dp_replicate": 12},
}


@pytest.mark.parametrize("order", sorted(STRIDES))
def test_global_rank_and_coords_follow_the_rank_order(order: str) -> None:
    degrees = {"pp": 2, "dp_replicate": 2, "dp_shard": 3, "tp": 2}
    layout = Layout(**degrees, rank_order=order)
    stride = STRIDES[order]
    seen = set()
    for values in itertools.product(*(range(d) for d in degrees.values())):
        at = dict(zip(degrees, values, strict=True))
        rank = sum(stride[a] * i for a, i in at.items())
        assert layout.global_rank(at) == rank
        assert layout.coords(rank) == {**at, "cp": 0}
        dp_index = at["dp_replicate"] * 3 + at["dp_shard"]
        assert layout.index("dp", rank) == dp_index
        assert layout.global_rank({"pp": at["pp"], "dp": dp_index, "tp": at["tp"]}) == rank
        assert layout.batch_shard(rank) == (dp_index, 6)
        tp_group = [rank - stride["tp"] * at["tp"] + stride["tp"] * t for t in range(2)]
        assert layout.ranks("tp", rank) == tp_group
        seen.add(rank)
    assert seen == set(range(24)) and layout.size == 24


def test_expert_views_borrow_the_data_and_tensor_parallel_ranks() -> None:
    # dp_shard = 4, ep = 2: ranks 0..3 read as edp × ep with ep innermost
    layout = Layout(dp_shard=4, ep=2)
    assert _groups(layout, "ep") == _set((0, 1), (2, 3))
    assert _groups(layout, "edp") == _set((0, 2), (1, 3))
    assert layout.degree("edp") == 2
    # replicate 2 × shard 2 × tp 2, ep 4: dp·tp index = rank under tp-dp-pp
    hsdp = Layout(dp_replicate=2, dp_shard=2, tp=2, ep=4)
    assert _groups(hsdp, "ep") == _set((0, 1, 2, 3), (4, 5, 6, 7))
    assert hsdp.ranks("edp", 5) == [1, 5] and hsdp.index("ep", 6) == 2
    assert hsdp.index("edp", 6) == 1
    # the same under dp-tp-pp: rank = shard + 2·replicate + 4·tp, flat = dp·2 + tp
    swapped = Layout(dp_replicate=2, dp_shard=2, tp=2, ep=4, rank_order="dp-tp-pp")
    assert swapped.ranks("ep", 0) == [0, 4, 1, 5] and swapped.ranks("edp", 4) == [4, 6]


def test_bad_layouts_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="dp_shard=0 must be a positive"):
        Layout(dp_shard=0)
    with pytest.raises(ValueError, match="ep=3 does not divide"):
        Layout(dp_shard=4, ep=3)
    with pytest.raises(ValueError, match="rank_order='dp-tp' is unknown"):
        Layout(rank_order="dp-tp")
    with pytest.raises(ValueError, match="axis 'sp' is unknown"):
        Layout().degree("sp")
    with pytest.raises(ValueError, match="outside"):
        Layout(pp=2).global_rank({"pp": 2})
    with pytest.raises(ValueError, match="not both"):
        Layout(dp_shard=2).global_rank({"dp": 1, "dp_shard": 1})


@pytest.mark.parametrize("order", RANK_ORDERS)
def test_every_group_holds_the_ranks_that_differ_only_along_its_axis(order: str) -> None:
    """Brute force over every rank of layouts with each axis of degree 1 to 3: the group of
    a rank along an axis (or dp, the two data-parallel axes read as one) is every rank whose
    other coordinates are its own, in the order of their index along it."""
    for pp, rep, shard, cp, tp in itertools.product((1, 3), (1, 2), (1, 3), (1, 2), (1, 2)):
        layout = Layout(pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, rank_order=order)
        at = [layout.coords(r) for r in range(layout.size)]
        assert sorted(layout.global_rank(c) for c in at) == list(range(layout.size))
        for axis, inside in [*((a, (a,)) for a in AXES), ("dp", ("dp_replicate", "dp_shard"))]:
            for r in range(layout.size):
                same = [q for q in range(layout.size)
                        if all(at[q][a] == at[r][a] for a in AXES if a not in inside)]  # fmt: skip
                same.sort(key=lambda q: tuple(at[q][a] for a in inside))
                assert layout.ranks(axis, r) == same
