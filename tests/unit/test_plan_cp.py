"""The planner searches context parallelism for long sequences: cp degrees dividing the
devices whose 2·cp chunks divide the sequence, synchronous schedules only, no HSDP; a 7B GPT
on a 32k-token sequence on a DGX-H100 gets cp > 1 and an explanation naming it; a short
sequence keeps cp = 1."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.cli.main import main
from plait.plan import SearchSpace, gpt_spec
from plait.plan.space import candidates, context_degrees
from plait.schedule import KINDS

GPT_7B = dict(num_layers=32, hidden=4096, num_heads=32, vocab_size=50304)


def test_cp_degrees_searched() -> None:
    space = SearchSpace()
    long = gpt_spec(**GPT_7B, seq_len=32768)
    assert context_degrees(long, space, 64) == [1, 2, 4, 8, 16, 32]
    assert context_degrees(long, space, 24) == [1, 2, 4, 8]  # dividing the devices
    odd = gpt_spec(**GPT_7B, seq_len=8200)  # 8200 = 8 · 1025: 2·cp divides it up to cp=4
    assert context_degrees(odd, space, 64) == [1, 2, 4]
    assert context_degrees(gpt_spec(**GPT_7B, seq_len=2048), space, 64) == [1]  # short


def test_cp_candidates_are_synchronous_uncompressed_and_not_hybrid() -> None:
    space = SearchSpace(allow_staleness=True, compress=("none", "fp16"))
    model = gpt_spec(**GPT_7B, seq_len=16384)
    plans = list(candidates(model, space, num_devices=16, devices_per_node=8, global_batch=16))
    split = [p for p in plans if p.cp > 1]
    assert {p.cp for p in split} == {2, 4, 8, 16}
    assert all(KINDS[p.schedule].synchronous for p in split)
    assert all(p.compress == "none" and p.dp_replicate is None for p in split)
    assert all(p.world_size == 16 for p in plans)
    assert any(not KINDS[p.schedule].synchronous for p in plans if p.cp == 1)


def test_sequence_parallel_candidates_split_each_cp_rank_s_tokens_over_tp() -> None:
    model = gpt_spec(**GPT_7B, seq_len=8200)  # cp=4 ranks hold 2050 tokens: 2 | 2050, 8 ∤
    plans = list(candidates(model, SearchSpace(), num_devices=16, devices_per_node=8,
                            global_batch=16))  # fmt: skip
    sp = {(p.cp, p.tp) for p in plans if p.sequence_parallel}
    assert (4, 2) in sp and (4, 8) not in sp and (2, 8) not in sp and (1, 8) in sp
    assert all((8200 // cp) % tp == 0 for cp, tp in sp)


def _plan(capsys: pytest.CaptureFixture[str], seq_len: int, batch: int) -> dict[str, Any]:
    code = main(["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len",
                 str(seq_len), "--vocab", "50304", "--batch-size", str(batch), "--cluster",
                 "dgx-h100", "--nodes", "1", "--dtype", "bf16", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def test_a_32k_sequence_of_a_7b_gpt_gets_cp(capsys: pytest.CaptureFixture[str]) -> None:
    found = _plan(capsys, 32768, 16)
    cp = found["best"]["cp"]
    assert cp > 1
    why = found["explanation"]
    assert f"cp={cp}: it splits each 32768-token sequence over {cp} ranks" in why
    assert "with cp=1" in why  # against the best plan without it


def test_a_short_sequence_keeps_cp_1(capsys: pytest.CaptureFixture[str]) -> None:
    found = _plan(capsys, 2048, 64)
    assert "cp" not in found["best"]
    assert all("cp" not in p for p in found["plans"])
    assert "cp=" not in found["explanation"]
