"""`plait bench faults` end to end, one trial: its JSON keys, and a recovered, exact run."""

from __future__ import annotations

import json

import pytest

from plait.cli.main import main

pytestmark = pytest.mark.dist


def test_one_fault_trial_recovers_bit_identical(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "faults", "--trials", "1", "--steps", "8", "--every", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"trials", "recovered", "bit_identical", "median_recovery_s", "max_recovery_s",
            "lost_steps_median"} <= out.keys()  # fmt: skip
    assert (out["trials"], out["recovered"], out["bit_identical"]) == (1, 1, 1), out
    trial = out["per_trial"][0]
    assert trial["cause"] == "SIGKILL" and 0 <= trial["failed_rank"] < 2
    assert trial["resumed_from"] <= trial["steps_done_at_kill"]
    assert trial["lost_steps"] == trial["steps_done_at_kill"] - trial["resumed_from"]
    assert 0 < out["median_recovery_s"] <= out["max_recovery_s"]
