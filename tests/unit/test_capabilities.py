"""`plait capabilities`: the matrix holds the rules the docs state, the passes' refusals
reach it, and docs/capabilities.md is the command's current output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plait.config import ParallelPlan
from plait.train.capabilities import FEATURES, matrix, refusal
from plait.train.passes import Request, refusals

ROOT = Path(__file__).resolve().parents[2]
BY_NAME = {f.name: f for f in FEATURES}


@pytest.fixture(scope="module")
def refused() -> dict[frozenset[str], str]:
    return {frozenset((a, b)): why for a, b, why in matrix()}


# rules as docs/parallelism.md and docs/planning.md state them, written out by hand
REFUSED = [
    ("tp", "schedule pipedream"),  # weight copies of tensor-parallel shards
    ("zero-3", "schedule 2bw"),  # FSDP-sharded weights are not copied per version
    ("fp16", "schedule xpipe"),  # no global inf check across asynchronous updates
    ("tp", "schedule chimera"),  # replica sums on whole tensors
    ("zero-2", "compress powersgd"),  # FSDP's reduce-scatter only lowers its dtype
    ("ep", "compile"),  # the experts' all-to-all is not compiled
    ("tp", "zero-1"),  # ZeroRedundancyOptimizer takes plain tensors
    ("cp", "schedule pipedream"),  # the ring runs under synchronous schedules only
    ("cp", "compile"),
    ("cp", "ep"),
]
COMBINE = [
    ("tp", "zero-3"),
    ("dp", "schedule pipedream"),
    ("recompute full", "compile"),
    ("bf16", "schedule 2bw"),
    ("zero-2", "compress bf16" if "compress bf16" in BY_NAME else "compress fp16"),
    ("ep", "zero-3"),
    ("schedule zb-v", "recompute selective"),
    ("cp", "tp"),
    ("cp", "zero-3"),
    ("cp", "schedule zb-v"),
    ("cp", "recompute full"),
]


@pytest.mark.parametrize(("a", "b"), REFUSED)
def test_documented_refusals_are_in_the_matrix(a: str, b: str, refused: dict) -> None:
    assert frozenset((a, b)) in refused, (a, b)


@pytest.mark.parametrize(("a", "b"), COMBINE)
def test_documented_combinations_are_not_refused(a: str, b: str, refused: dict) -> None:
    assert frozenset((a, b)) not in refused, refused.get(frozenset((a, b)))


def test_a_pass_refusal_is_what_parallelize_would_raise() -> None:
    plan = ParallelPlan(dp=2, ep=2)
    assert refusals(Request(plan, compile=True)) == [refusal(BY_NAME["ep"], BY_NAME["compile"])]
    assert refusals(Request(plan, compile=False)) == []
    assert refusals(Request(plan, mesh_given=True))[0].startswith("experts: ep=2 with a mesh")


def test_alternatives_are_not_pairs() -> None:
    assert refusal(BY_NAME["zero-1"], BY_NAME["zero-3"]) is None
    assert refusal(BY_NAME["schedule gpipe"], BY_NAME["schedule 2bw"]) is None


def test_docs_page_is_the_commands_output() -> None:
    out = subprocess.run([sys.executable, "-m", "plait", "capabilities"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout  # fmt: skip
    page = (ROOT / "docs" / "capabilities.md").read_text()
    assert page.endswith(out), "docs/capabilities.md is stale: regenerate it from the command"
