"""`plait plan` and `plait simulate` print what they printed when the outputs were recorded
(scripts/cli_golden.py --write): layout, config and CLI changes must not move a figure."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cli_golden", ROOT / "scripts" / "cli_golden.py")
assert _spec is not None and _spec.loader is not None
golden = importlib.util.module_from_spec(_spec)
sys.modules["cli_golden"] = golden
_spec.loader.exec_module(golden)

QUICK = [name for name, (_, quick) in golden.CASES.items() if quick]


def test_every_case_has_a_recording() -> None:
    for name in golden.CASES:
        assert (golden.GOLDEN / f"{name}.json").is_file(), name


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    """The local-cpu plan, made once: its output and the folder of its plan file."""
    folder = tmp_path_factory.mktemp("golden")
    return folder, golden.run_case(golden.CASES["plan_local_cpu"][0], str(folder))


@pytest.mark.parametrize("name", QUICK)
def test_output_unchanged(name: str, planned: tuple[Path, dict[str, object]]) -> None:
    folder, plan = planned
    value = (
        plan if name == "plan_local_cpu" else golden.run_case(golden.CASES[name][0], str(folder))
    )
    assert value == json.loads((golden.GOLDEN / f"{name}.json").read_text())
