"""The decisions `--plan auto` keeps: found again under the same key only, and a folder
that cannot be written or a damaged file costs a new decision, never an error."""

from __future__ import annotations

from pathlib import Path

from plait.train import decisions

_CFG = {"model": {"name": "gpt", "num_layers": 2}, "batch_size": 8, "nproc": 2, "plan": "auto"}
_PLAN = {"dp": 2, "tp": 1, "pp": 1, "decision": {"source": "measured", "workers": 2}}


def test_a_kept_decision_is_found_under_its_key_only(tmp_path: Path) -> None:
    key = decisions.decision_key(_CFG, 2, "cpu")
    saved = decisions.save(key, _PLAN, tmp_path)
    found = decisions.load(key, tmp_path)
    assert found is not None and saved["decision"]["file"] == found["decision"]["file"]
    assert {k: found[k] for k in ("dp", "tp", "pp")} == {"dp": 2, "tp": 1, "pp": 1}
    assert found["decision"]["source"] == "kept"
    assert found["decision"]["kept_from"] == "measured"
    assert decisions.load(decisions.decision_key(_CFG, 4, "cpu"), tmp_path) is None
    other = {**_CFG, "batch_size": 16}
    assert decisions.load(decisions.decision_key(other, 2, "cpu"), tmp_path) is None


def test_settings_the_planner_does_not_read_keep_the_decision() -> None:
    steps = {**_CFG, "max_steps": 1000, "seed": 7, "run_dir": "elsewhere", "replan": True}
    assert decisions.decision_key(steps, 2, "cpu") == decisions.decision_key(_CFG, 2, "cpu")


def test_a_damaged_file_or_an_unwritable_folder_costs_a_new_decision(tmp_path: Path) -> None:
    key = decisions.decision_key(_CFG, 2, "cpu")
    path = Path(decisions.save(key, _PLAN, tmp_path)["decision"]["file"])
    path.write_text("{not json")
    assert decisions.load(key, tmp_path) is None
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    saved = decisions.save(key, _PLAN, blocked / "plans")  # a folder under a file
    assert saved["decision"]["file"] is None and saved["dp"] == 2
