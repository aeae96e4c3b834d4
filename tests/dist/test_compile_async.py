"""`compile=True` with every asynchronous schedule kind against the emulator of
tests/dist/test_async_pipeline.py (weight copies of compiled blocks included); apart from
tests/dist/test_compile.py so that the two compile in two workers side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.schedule import KINDS

from .harness import run_world
from .test_async_pipeline import _check as _async_check

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _every_asynchronous_kind(rank: int, world: int) -> None:
    for name, kind in KINDS.items():
        if not kind.synchronous:  # weight copies of compiled blocks (eager) included
            _async_check(rank, world, name, 2, 2, "gpt", "sgd", compile=True)


@pytest.mark.timeout(1200)
def test_compiled_blocks_of_asynchronous_kinds_match_the_emulator(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _every_asynchronous_kind)
