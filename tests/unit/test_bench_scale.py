"""`plait bench scale --cases command`: the `plait plan` command timed as a user runs it."""

from __future__ import annotations

import argparse

import pytest

from plait.bench import scale


def test_the_command_case_runs_the_plan_command_in_new_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a small plan in place of the trillion-parameter one: the mechanism, not the figure
    monkeypatch.setattr(scale, "COMMAND", "plan --layers 2 --hidden 64 --heads 2 --seq-len 32 "
                        "--batch-size 8 --cluster dgx-a100-80gb --nodes 1 --json")  # fmt: skip
    out = scale.run_bench(repeats=2, cases=("command",))
    assert len(out["command_all_s"]) == 2 and min(out["command_all_s"]) == out["command_wall_s"]
    assert out["command_wall_s"] <= out["command_median_s"] <= max(out["command_all_s"])
    assert out["command_met"] == (out["command_median_s"] < scale.PLAN_TARGET_S)
    assert out["command"].startswith("plait plan --layers 2")


def test_an_unknown_case_is_refused_naming_the_cases() -> None:
    args = argparse.Namespace(repeats=1, cases="plan,nope", json=True)
    with pytest.raises(SystemExit, match=r"choose from \['sim', 'plan', 'command'\]"):
        scale.run(args)
