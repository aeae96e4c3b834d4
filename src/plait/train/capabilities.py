"""Which features combine: the matrix generated from the refusals where they live.

Each feature is the smallest plan (and `parallelize` request) that turns it on. A pair of
features is built together and asked of the plan's checks (`ParallelPlan.__post_init__`,
with the schedule facts and the hetero/WSP checks it calls) and of the transform passes
(`plait.train.passes.refusals`); the first refusal is the pair's reason. Nothing here
decides a rule: a rule changed where it lives changes this matrix, and `plait
capabilities` prints it (docs/capabilities.md holds a copy that a test keeps current).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from plait.config import ParallelPlan
from plait.schedule import KINDS
from plait.train.passes import Request, refusals

__all__ = ["FEATURES", "Feature", "matrix", "refusal", "render"]

_CHUNKS = {"interleaved": 2, "zb-v": 2}


@dataclass(frozen=True)
class Feature:
    """A feature, as the plan fields (and `parallelize` options) that turn it on."""

    name: str
    plan: tuple[tuple[str, Any], ...]
    compile: bool = False


def _f(name: str, compile: bool = False, **plan: Any) -> Feature:
    return Feature(name, tuple(sorted(plan.items())), compile)


FEATURES: tuple[Feature, ...] = (
    _f("dp", dp=2),
    _f("tp", tp=2),
    _f("cp", cp=2),
    _f("sequence parallel", tp=2, sequence_parallel=True),
    _f("zero-1", dp=2, zero=1),
    _f("zero-2", dp=2, zero=2),
    _f("zero-3", dp=2, zero=3),
    _f("ep", dp=2, ep=2),
    _f("recompute selective", recompute="selective"),
    _f("recompute full", recompute="full"),
    _f("compile", compile=True),
    _f("bf16", dtype="bf16"),
    _f("fp16", dtype="fp16"),
    _f("compress fp16", dp=2, compress="fp16"),
    _f("compress powersgd", dp=2, compress="powersgd:2"),
    _f("compress dgc", dp=2, compress="dgc:0.01"),
    _f("offload activations", offload_activations="all"),
    _f("offload optimizer", offload_optimizer=True),
    _f("wsp", dp=2, wsp_staleness=1),
    *(
        _f(f"schedule {name}", schedule=name, pp=2, microbatches=4, chunks=_CHUNKS.get(name, 1))
        for name in KINDS
    ),
)


def refusal(*features: Feature) -> str | None:
    """Why `features` together cannot train, or None. Features that set one field to two
    values (two schedules, two ZeRO stages) are alternatives, not a combination: None."""
    fields: dict[str, Any] = {}
    for feature in features:
        for key, value in feature.plan:
            if fields.get(key, value) != value:
                return None
            fields[key] = value
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = ParallelPlan(**fields)
    except ValueError as err:
        return str(err)
    found = refusals(Request(plan, compile=any(f.compile for f in features)))
    return found[0] if found else None


def matrix(features: tuple[Feature, ...] = FEATURES) -> list[tuple[str, str, str]]:
    """Every refused pair: (feature, feature, reason), in `features` order. A feature that
    cannot run alone is listed with itself."""
    out = [(f.name, f.name, why) for f in features if (why := refusal(f)) is not None]
    for a, b in combinations(features, 2):
        if refusal(a) is None and refusal(b) is None and (why := refusal(a, b)) is not None:
            out.append((a.name, b.name, why))
    return out


def render(features: tuple[Feature, ...] = FEATURES) -> str:
    """The matrix as Markdown: the features, then each refused pair with its reason."""
    lines = [
        "Features (each is the smallest plan that turns it on): "
        + ", ".join(f"`{f.name}`" for f in features)
        + ".",
        "",
        "Every pair not listed passes every check made before training starts. Refused pairs, "
        "with the reason the code gives:",
        "",
        "| feature | with | refused because |",
        "| --- | --- | --- |",
    ]
    for a, b, why in matrix(features):
        lines.append(f"| {a} | {b} | {why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
