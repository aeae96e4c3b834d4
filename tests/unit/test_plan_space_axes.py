"""`factorisations` yields every assignment of degrees to named axes whose product is the
device count and which the axes' rules admit, in lexicographic order."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import product
from math import prod

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.plan.axes import Rule, factorisations


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
