"""`plait bench faults --out DIR` keeps each mode's trials as the mode ends, and a later run
with the same settings takes them from there instead of running the mode again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plait.bench import faults


def _fake_trials(calls: list[str]) -> Any:
    def run_mode(config: faults.FaultsConfig, root: Path, mode: str) -> list[dict[str, Any]]:
        calls.append(mode)
        return [{"trial": 0, "recovered": True, "bit_identical": True, "recovery_s": 1.5,
                 "lost_steps": 2, "kill_after_steps": 3}]  # fmt: skip

    return run_mode


def test_kept_modes_are_not_run_again_and_other_settings_run_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(faults, "_run_mode", _fake_trials(calls))
    config = faults.FaultsConfig(trials=1, modes=("1f1b", "tp"))
    first = faults.run_bench(config, out=tmp_path)
    assert calls == ["1f1b", "tp"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "1f1b.json", "tp.json"]  # fmt: skip
    again = faults.run_bench(faults.FaultsConfig(trials=1, modes=("1f1b", "tp", "zero3")),
                             out=tmp_path)  # fmt: skip
    assert calls == ["1f1b", "tp", "zero3"]  # only the mode not kept ran
    assert again["modes"]["1f1b"] == first["modes"]["1f1b"]
    faults.run_bench(faults.FaultsConfig(trials=1, steps=12, modes=("1f1b",)), out=tmp_path)
    assert calls[-1] == "1f1b"  # other settings: the kept trials do not count


def test_a_trial_that_does_not_end_in_time_counts_as_not_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that outlives the trial's time (a loaded host, a hang) is one trial not
    recovered, with why; the bench goes on instead of stopping on a traceback."""
    import random
    import sys

    hang = [sys.executable, "-c", "import time; time.sleep(600)"]
    monkeypatch.setattr(faults, "train_command", lambda *a, **k: hang)
    config = faults.FaultsConfig(trials=1, trial_timeout_s=0.5)
    outcome = faults.run_trial(config, tmp_path, 0, random.Random(0), {}, "1f1b")
    assert outcome["recovered"] is False and outcome["bit_identical"] is False
    assert "ended before step" in outcome["unfinished"]


def test_the_trial_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="trial_timeout_s=0"):
        faults.FaultsConfig(trial_timeout_s=0)
