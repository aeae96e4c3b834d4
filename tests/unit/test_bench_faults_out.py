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
