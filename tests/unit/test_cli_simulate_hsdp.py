"""`plait simulate --dp-replicate R --dp-shard S` predicts hybrid sharding: state sharded
over S ranks (not R·S), the plan's axes in the JSON, inconsistent axes refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.cli.main import main

MODEL = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "512",
         "--vocab", "32000", "--cluster", "dgx-a100-80gb", "--microbatches", "4"]  # fmt: skip


def _simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["simulate", *MODEL, *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def test_hsdp_shards_over_dp_shard_and_names_its_axes(capsys: pytest.CaptureFixture[str]) -> None:
    hsdp = _simulate(capsys, "--dp-replicate", "2", "--dp-shard", "8")
    fsdp = _simulate(capsys, "--dp", "16", "--zero", "3")
    only8 = _simulate(capsys, "--dp", "8", "--zero", "3")
    plan = hsdp["plan"]
    assert (plan["dp"], plan["dp_replicate"], plan["dp_shard"], plan["zero"]) == (16, 2, 8, 3)
    assert "dp_replicate" not in fsdp["plan"]
    for key in ("params", "grads", "optimizer"):
        assert hsdp["memory"][0][key] == pytest.approx(only8["memory"][0][key])
        assert hsdp["memory"][0][key] == pytest.approx(2 * fsdp["memory"][0][key])


def test_inconsistent_axes_exit_2_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", *MODEL, "--dp", "8", "--dp-replicate", "2", "--dp-shard", "2"])
    assert code == 2
    assert "dp=8 but dp_replicate × dp_shard = 2 × 2 = 4" in capsys.readouterr().err
