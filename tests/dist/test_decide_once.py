"""`--plan auto` decides once: `plait train --dry-run` prints the plan that `plait train`
with the same flags then trains under, whichever of the two decided it, and `--replan`
decides again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from plait.config.sections import flat_plan_file
from plait.cli.main import main

pytestmark = pytest.mark.dist

_FLAGS = ["--nproc", "2", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
          "--batch-size", "8", "--sample-chars", "0", "--eval-batches", "0", "-q"]  # fmt: skip
_KEYS = ("dp", "tp", "pp", "schedule", "microbatches", "chunks", "zero", "recompute")


def _previewed(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[dict[str, str], str]:
    assert main(["train", "--dry-run", *_FLAGS, *extra]) == 0
    said = capsys.readouterr().out.splitlines()
    line = next((x for x in said if x.startswith("plait train --dry-run: valid")), str(said))
    found = re.search(r"--plan auto chooses (.*?) \(predicted [\d.]+ ms a step; ([^;]+);", line)
    assert found is not None, line
    layout = dict(part.split("=") for part in found.group(1).split(", "))
    return layout, found.group(2)


def _trained(run_dir: Path) -> dict[str, str]:
    assert main(["train", *_FLAGS, "--max-steps", "1", "--run-dir", str(run_dir)]) == 0
    plan = flat_plan_file(json.loads((run_dir / "plan.json").read_text()))
    return {k: str(plan[k]) for k in _KEYS} | {"source": plan["decision"]["source"]}


def test_the_dry_run_shows_the_plan_the_run_trains_under(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    previewed, how = _previewed(capsys)
    assert how == "planned now"
    trained = _trained(tmp_path / "a")
    assert trained == previewed | {"source": "kept"}
    again, how = _previewed(capsys)
    assert again == previewed and how == "planned earlier for these flags on this host"
    _, how = _previewed(capsys, "--replan")
    assert how == "planned now"


def test_a_run_that_decided_first_is_what_the_dry_run_shows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    trained = _trained(tmp_path / "b")
    assert trained.pop("source") == "measured"  # the workers measured and decided
    previewed, how = _previewed(capsys)
    assert previewed == trained
    assert how == "decided earlier by the workers of a run with these flags on this host"
