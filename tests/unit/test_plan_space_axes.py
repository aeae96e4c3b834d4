"""The planner enumerates factorisations over the layout's axes: `factorisations` yields
every admitted assignment of degrees whose product is the device count, in lexicographic
order, and the candidates built on it are those of a brute force over every degree tuple
with the planner's rules written out here, in the same order (the search breaks ties by
it)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields, replace
from itertools import product
from math import prod

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.cost import MoEShape
from plait.layout import AXES
from plait.plan import SearchSpace, gpt_spec, moe_spec
from plait.plan.axes import Rule, factorisations
from plait.plan.space import (
    DP_AXES,
    PLANNED_AXES,
    ModelSpec,
    _layouts,
    _uneven,
    candidates,
)
from plait.sim import SimPlan


def _brute(n: int, axes: tuple[str, ...], rules: Mapping[str, Rule]) -> list[dict[str, int]]:
    out = []
    every = [d for d in range(1, n + 1) if n % d == 0]  # the only degrees a product n takes
    for values in product(every, repeat=len(axes)):
        if prod(values) != n:
            continue
        degrees = dict(zip(axes, values, strict=True))
        admitted = all(
            axis not in rules or rules[axis](d, {a: degrees[a] for a in axes[:i]})
            for i, (axis, d) in enumerate(degrees.items())
        )
        if admitted:
            out.append(degrees)
    return out


RULES: dict[str, Rule] = {
    "a": lambda d, _: d % 2 == 1,  # odd
    "b": lambda d, before: d >= before.get("a", 1),  # reads "a" where it comes first
    "c": lambda d, _: d <= 6,
}


@pytest.mark.parametrize("axes", [(), ("a",), ("a", "b"), ("b", "a"), ("a", "b", "c", "d")])
@pytest.mark.parametrize("ruled", [False, True])
def test_factorisations_are_those_of_a_brute_force(axes: tuple[str, ...], ruled: bool) -> None:
    rules = {k: v for k, v in RULES.items() if k in axes and ruled}
    for n in [*range(1, 41), 48, 64, 96]:
        assert list(factorisations(n, axes, rules)) == _brute(n, axes, rules), (n, axes)


@given(st.integers(1, 360), st.integers(1, 4))
def test_every_factorisation_multiplies_to_n(n: int, k: int) -> None:
    axes = tuple("wxyz"[:k])
    found = list(factorisations(n, axes))
    assert all(prod(f.values()) == n and tuple(f) == axes for f in found)
    assert [tuple(f.values()) for f in found] == sorted({tuple(f.values()) for f in found})
    assert len(found) == len(_brute(n, axes, {}))


def test_factorisations_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="positive integer"):
        list(factorisations(0, ("a",)))
    with pytest.raises(ValueError, match="twice"):
        list(factorisations(4, ("a", "a")))


def test_every_layout_axis_is_planned() -> None:
    # a new axis of the layout needs its place in PLANNED_AXES (and its rule) or DP_AXES
    assert (set(PLANNED_AXES) - {"dp"}) | set(DP_AXES) == set(AXES)


# --- the candidates against a brute force with the rules written out --------------------


def _node_share(dp: int, tp: int, pp: int, order: str, per_node: int) -> int:
    """The ranks of data-parallel group 0 on node 0: ranks i · stride, the stride being the
    degrees of the axes inside dp in `order` (cp = 1 here)."""
    inner = order.split("-")[: order.split("-").index("dp")]
    stride = prod({"tp": tp, "pp": pp}[a] for a in inner)
    return sum(1 for i in range(dp) if i * stride < per_node)


def _reference(
    model: ModelSpec, space: SearchSpace, n: int, per_node: int, batch: int
) -> Iterator[SimPlan]:
    long = model.context_parallel and not model.num_experts
    long = long and model.seq_len >= space.cp_min_seq_len
    experts = model.num_experts > 0
    for cp, tp, pp in product(range(1, n + 1), repeat=3):
        if n % (cp * tp * pp):
            continue
        dp = n // (cp * tp * pp)
        if cp != 1 and (not long or cp not in space.cp or model.seq_len % (2 * cp)):
            continue
        if per_node % tp or model.num_heads % tp or pp > model.num_blocks:
            continue
        yield from _layouts(model, space, dp, tp, pp, batch, cp)
        if space.uneven_shares and not experts and dp >= 2 and tp == 1 and cp == 1:
            yield from _uneven(model, space, dp, pp, batch)
        zeros = tuple(z for z in space.zero_stages if z >= 2)
        if not space.hybrid or experts or not zeros or cp != 1:
            continue
        for order in space.rank_orders if pp > 1 else space.rank_orders[:1]:
            share = _node_share(dp, tp, pp, order, per_node)
            for rep, shard in product(range(1, dp + 1), repeat=2):
                if rep * shard == dp and 1 < shard < dp and shard == share:
                    narrowed = replace(space, zero_stages=zeros, rank_orders=(order,))
                    for plan in _layouts(model, narrowed, dp, tp, pp, batch):
                        yield replace(plan, dp_replicate=rep, dp_shard=shard)


def _key(plan: SimPlan) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(plan.to_dict().items()))


GPT = gpt_spec(num_layers=24, hidden=2048, num_heads=16, seq_len=2048, vocab_size=50304)
SMALL = gpt_spec(num_layers=4, hidden=256, num_heads=8, seq_len=128, vocab_size=1000)
LONG = gpt_spec(num_layers=32, hidden=4096, num_heads=32, seq_len=16384, vocab_size=50304)
MOE = moe_spec(num_layers=12, hidden=1024, num_heads=16, seq_len=1024, vocab_size=50304,
               moe=MoEShape(num_experts=8))  # fmt: skip
# fewer options than the default: the degrees are under test, not the options of each
LEAN = SearchSpace(recompute=("none", "full"), micro_batch_sizes=(1, 2, 4),
                   rank_orders=("tp-dp-pp", "tp-pp-dp"), sequence_parallel=(False,))  # fmt: skip

CASES = {
    "small cpu cluster": (SMALL, SearchSpace(), 4, 4, 32),
    "8 devices a node, 4 nodes": (GPT, LEAN, 32, 8, 64),
    "experts": (MOE, LEAN, 32, 8, 64),
    "long sequence, cp > 1": (LONG, LEAN, 32, 8, 32),
    "batch that does not divide": (GPT, LEAN, 24, 8, 50),
    "odd devices, no hybrid": (SMALL, replace(LEAN, hybrid=False), 6, 3, 7),
    # no cp > 1 divides an odd sequence into 2·cp chunks; cp = 1 still plans it
    "odd long sequence": (replace(LONG, seq_len=16383), LEAN, 8, 8, 8),
}


@pytest.mark.parametrize("case", CASES)
def test_candidates_are_those_of_a_brute_force(case: str) -> None:
    model, space, n, per_node, batch = CASES[case]
    found = [_key(p) for p in candidates(model, space, num_devices=n, devices_per_node=per_node,
                                          global_batch=batch)]  # fmt: skip
    expected = [_key(p) for p in _reference(model, space, n, per_node, batch)]
    assert found, case
    assert sorted(found) == sorted(expected)
    assert found == expected  # in the same order too: the search breaks ties by it


def test_the_cases_reach_every_kind_of_plan() -> None:
    def plans(case: str) -> list[SimPlan]:
        model, space, n, per_node, batch = CASES[case]
        return list(candidates(model, space, num_devices=n, devices_per_node=per_node,
                               global_batch=batch))  # fmt: skip

    assert {p.cp for p in plans("long sequence, cp > 1")} == {1, 2, 4, 8, 16, 32}
    assert {p.cp for p in plans("odd long sequence")} == {1}
    assert {p.ep for p in plans("experts")} == {1, 2, 4, 8}
    assert any(p.total_microbatches for p in plans("batch that does not divide"))
    assert any(p.dp_replicate for p in plans("8 devices a node, 4 nodes"))
    assert any(p.dp_replicate for p in plans("long sequence, cp > 1"))


@pytest.mark.parametrize("case", CASES)
def test_every_candidate_is_what_the_checked_constructor_builds(case: str) -> None:
    # candidates that differ from a checked one only in batch shape are copied unchecked
    # (`plait.plan.space._reshaped`): each must be the plan the checked constructor gives
    model, space, n, per_node, batch = CASES[case]
    found = list(candidates(model, space, num_devices=n, devices_per_node=per_node,
                            global_batch=batch))  # fmt: skip
    assert len({(p.microbatches, p.micro_batch_size) for p in found}) > 1, case
    for plan in found:
        checked = SimPlan(**{f.name: getattr(plan, f.name) for f in fields(SimPlan)})
        assert vars(checked) == vars(plan), plan
