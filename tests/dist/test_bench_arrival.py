"""`plait bench arrival` in its shortest form: every pattern and size timed once per call
on both workers, and the table's numbers are the samples' statistics."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from plait.bench.arrival import PATTERNS
from plait.cli.main import main

pytestmark = pytest.mark.dist


def test_every_pattern_and_size_is_timed() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "arrival", "--workers", "2", "--sizes", "1,4", "--calls", "3",
                     "--warmup", "1", "--compute-ms", "0.5", "--late-ms", "0.5",
                     "--jitter-ms", "0.2", "--json"])  # fmt: skip
    assert code == 0
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    assert set(result["patterns"]) == set(PATTERNS)
    for sizes in result["patterns"].values():
        assert set(sizes) == {"1", "4"}
        for s in sizes.values():
            assert len(s["samples_s"]) == 3 and min(s["samples_s"]) > 0
            assert s["median_s"] == pytest.approx(statistics.median(s["samples_s"]))
            assert s["max_s"] == max(s["samples_s"])
