"""Every factorisation of a device count over named layout axes that their rules admit.

The planner (`plait.plan.space`) enumerates its layouts here: a rule per axis says which
degrees the axis may take, so a new axis of `plait.layout.Layout` is one more name in the
tuple the planner factorises over and one more rule, not another nested loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

__all__ = ["Rule", "divisors", "factorisations"]

# whether an axis takes a degree, given the degrees of the axes before it
Rule = Callable[[int, Mapping[str, int]], bool]


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(
    n: int, axes: Sequence[str], rules: Mapping[str, Rule] | None = None
) -> Iterator[dict[str, int]]:
    """Every {axis: degree} over `axes` whose degrees multiply to `n` and which `rules`
    admit (an axis without a rule takes any degree), in lexicographic order of the degrees:
    the first axis outermost, each ascending. A rule sees the degrees of the axes before
    its own, so a rule between axes (tp divides what cp left, say) belongs to the later one.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n={n!r} must be a positive integer")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes={tuple(axes)} name an axis twice: give each once")
    if not axes:
        return iter([{}] if n == 1 else [])
    return _place(tuple(axes), rules or {}, n, {}, divisors(n))


def _place(
    axes: tuple[str, ...],
    rules: Mapping[str, Rule],
    rest: int,
    chosen: dict[str, int],
    candidates: list[int],
) -> Iterator[dict[str, int]]:
    """The factorisations of `rest` over `axes` after the degrees `chosen`; the last axis
    takes what the others leave. `candidates` (the divisors of the whole count) holds
    every divisor of `rest`, so it is computed once."""
    axis, inner = axes[0], axes[1:]
    rule = rules.get(axis)
    if not inner:
        if rule is None or rule(rest, chosen):
            yield {**chosen, axis: rest}
        return
    for degree in candidates:
        if degree > rest:
            break
        if rest % degree == 0 and (rule is None or rule(degree, chosen)):
            yield from _place(inner, rules, rest // degree, {**chosen, axis: degree}, candidates)
