"""`plait bench cp` at a tiny size: cp=1 and cp=2 each timed and measured, the activation
bytes per rank of cp=2 below cp=1's, and the simulator's prediction of them within 10%
of what autograd saved (measured here by its saved-tensor hooks, not by the cost model)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from plait.cli.main import main

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "cp", "--layers", "1", "--hidden", "32", "--heads", "2",
                     "--seq-len", "64", "--repeats", "2", "--steps", "1", "--json"])  # fmt: skip
    assert code == 0
    parsed: dict[str, Any] = json.loads(out.getvalue().strip().splitlines()[-1])
    return parsed


def test_each_cp_is_measured_and_predicted(result: dict[str, Any]) -> None:
    assert result["device"] == "cpu"
    assert result["memory_source"] == "autograd saved tensors"
    assert [c["cp"] for c in result["configs"]] == [1, 2]
    for c in result["configs"]:
        assert len(c["measured_step_all_s"]) == 2
        lo, hi = c["measured_step_spread_s"]
        assert 0 < lo <= c["measured_step_s"] <= hi
        assert c["predicted_step_s"] > 0
        assert c["measured_activation_bytes"] > 0
        assert abs(c["memory_relative_error"]) < 0.1


def test_cp2_keeps_fewer_activation_bytes_per_rank(result: dict[str, Any]) -> None:
    one, two = (c["measured_activation_bytes"] for c in result["configs"])
    assert result["activation_memory_ratio"] == pytest.approx(two / one)
    assert result["activation_memory_ratio"] < 1


def test_the_peer_says_why_it_did_not_run_on_cpu(result: dict[str, Any]) -> None:
    assert result["peer"].startswith("torch context_parallel: not run (CPU:")
