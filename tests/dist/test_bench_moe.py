"""`plait bench moe` in its shortest form: dropless top-k routing sends every token to k
experts, so the copies the ranks' experts receive add up to workers × tokens × k, in
plait's layer and in the peer's (given the same router weights, to the same experts)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from plait.bench.moe_peer import peer_version
from plait.cli.main import main

pytestmark = pytest.mark.dist

TOKENS, TOP_K, WORKERS = 24, 2, (1, 2)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "moe", "--workers", ",".join(map(str, WORKERS)), "--tokens",
                     str(TOKENS), "--hidden", "16", "--ffn", "24", "--experts", "4", "--top-k",
                     str(TOP_K), "--steps", "2", "--warmup", "1", "--json"])  # fmt: skip
    assert code == 0
    parsed: dict[str, Any] = json.loads(out.getvalue().strip().splitlines()[-1])
    return parsed


def test_plait_rows_count_every_copy(result: dict[str, Any]) -> None:
    assert result["config"]["peer_ffn"] == 16  # 2/3 of 24, a multiple of 8
    for w in WORKERS:
        row = result["workers"][str(w)]
        assert row["ep"] == w
        assert row["plait_received_copies"] == w * TOKENS * TOP_K
        assert row["plait_step_s"] > 0
        if peer_version() is None:  # plait's rows alone, and they say so
            assert row["peer_step_s"] is None and row["ratio"] is None


def test_peer_rows_route_like_plait(result: dict[str, Any]) -> None:
    if peer_version() is None:
        pytest.skip(f"the peer is not installed: {result['peer']['missing']}")
    assert result["peer"] == {"name": "torchtitan", "version": peer_version()}
    for w in WORKERS:
        row = result["workers"][str(w)]
        assert row["peer_received_copies"] == w * TOKENS * TOP_K
        assert row["routing_agrees"] == 1.0 and row["same_output_shape"]
        assert row["ratio"] == pytest.approx(row["plait_step_s"] / row["peer_step_s"])


def test_all_to_all_share_is_measured_and_predicted(result: dict[str, Any]) -> None:
    """Rows with an exchange time its five collectives (counts, dispatch, combine; the
    backward's two) and put the simulator's share next to the measured one."""
    assert "all_to_all_share_measured" not in result["workers"]["1"]
    row = result["workers"]["2"]
    assert row["all_to_all_calls"] == 5
    assert 0 < row["all_to_all_s"] < row["plait_step_s"]
    assert 0 < row["all_to_all_share_measured"] < 1 and 0 < row["all_to_all_share_predicted"] < 1
    want = abs(row["all_to_all_share_predicted"] - row["all_to_all_share_measured"])
    assert row["share_error"] == pytest.approx(want / row["all_to_all_share_measured"])
