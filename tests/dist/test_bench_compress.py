"""`plait bench compress` in its shortest form: the bytes it counts are what each method
sends by definition, and the DDP peers run the same hooks."""

from __future__ import annotations

import json

import pytest

from plait.cli.main import main

pytestmark = pytest.mark.dist


def test_counted_bytes_match_each_method(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "compress", "--workers", "2", "--steps", "6", "--warmup", "1",
                 "--methods", "none,fp16,powersgd:2,topk:0.01", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    res = out["workers"]["2"]
    n, m = res["num_params"], res["methods"]
    loss = 8  # plait's step also all-reduces its micro-batch's loss and count (fp32)
    assert m["none"]["bytes_sent_per_step"] == 4 * n + loss
    assert m["fp16"]["bytes_sent_per_step"] == 2 * n + loss
    # the same hook under DDP, whose step also all-reduces its loss (one fp32) to report it
    assert m["fp16"]["ddp_bytes_sent_per_step"] == 2 * n + 4
    k = -(-n // 100)  # ceil(0.01 n) indices and values, 4 bytes each
    assert m["topk:0.01"]["bytes_sent_per_step"] == 8 * k + loss
    assert m["powersgd:2"]["bytes_sent_per_step"] < m["fp16"]["bytes_sent_per_step"]
    for method in ("fp16", "powersgd:2"):
        assert m[method]["ratio_vs_ddp_hook"] > 0 and m[method]["ddp_step_s"] > 0
    assert set(m["none"]) >= {"bytes_sent_per_step", "step_s", "loss", "loss_vs_none"}
