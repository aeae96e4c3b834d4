"""torch's private names plait relies on (`plait.compat`) exist in the installed torch: when a
release moves one, this fails naming it, before any training does."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from plait import compat


@pytest.mark.parametrize(("module", "name"), compat.PRIVATE_NAMES)
def test_the_private_name_is_still_there(module: str, name: str) -> None:
    found = importlib.import_module(module)
    assert hasattr(found, name), f"torch moved {module}.{name}: update plait.compat"


def test_fsdp_param_groups_reads_both_torch_layouts() -> None:
    listed = SimpleNamespace(_fsdp_param_groups=["a", "b"])  # torch >= 2.12
    single = SimpleNamespace(_fsdp_param_group="a")  # torch 2.11
    empty = SimpleNamespace(_fsdp_param_group=None)
    assert compat.fsdp_param_groups(listed) == ["a", "b"]
    assert compat.fsdp_param_groups(single) == ["a"]
    assert compat.fsdp_param_groups(empty) == []


def test_the_profiler_flag_follows_the_profiler() -> None:
    import torch

    assert not compat.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert compat.profiler_enabled()
