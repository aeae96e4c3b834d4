"""The cp axis in the plan and on the command line, and what cp refuses before any worker
starts (each refusal names the fix)."""

from __future__ import annotations

import json

import pytest
import torch

from plait.cli.main import main
from plait.config import ParallelPlan
from plait.models import GPT, GPTConfig
from plait.train.context import check_model, cp_refusal
from plait.train.passes import Request, refusals


def _dry(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["train", "--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    return dict(json.loads(out[out.index("{") :]))


def test_cp_is_an_axis_of_the_layout_and_the_world() -> None:
    plan = ParallelPlan(dp=2, cp=2, pp=1)
    assert plan.world_size == 4 and plan.layout.cp == 2 and plan.layout.size == 4
    # cp sits between dp and tp: the cp ranks of a replica are neighbours under tp-dp-pp
    assert plan.layout.groups("cp") == [[0, 1], [2, 3]]
    assert plan.layout.groups("dp") == [[0, 2], [1, 3]]
    assert "cp" not in ParallelPlan(pp=1).to_dict()  # unset cp leaves outputs as they were
    assert ParallelPlan(**plan.to_dict()) == plan
    with pytest.raises(ValueError, match="cp=0"):
        ParallelPlan(cp=0)


def test_cp_flag_and_nproc_make_the_world(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _dry(["--nproc", "2", "--cp", "2", "--seq-len", "32"], capsys)
    assert cfg["layout"]["cp"] == 2 and cfg["layout"]["pp"] == 1  # type: ignore[index]


def test_cp_refuses_what_is_not_built_before_workers_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", "--dry-run", "--nproc", "2", "--cp", "2", "--schedule", "pipedream"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cp=2 with schedule='pipedream' is not supported yet: use a synchronous" in err


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"dp": 2, "ep": 2}, "ep=2 (MoE)"),
        ({"schedule": "pipedream"}, "schedule='pipedream'"),
        ({"dp": 2, "compress": "fp16"}, "compress='fp16'"),
        ({"dp_replicate": 2, "dp_shard": 2}, "HSDP"),
    ],
)
def test_each_refusal_names_the_value_and_the_fix(fields: dict[str, object], what: str) -> None:
    plan = ParallelPlan(**{"cp": 2, "pp": 1, **fields})  # type: ignore[arg-type]
    why = cp_refusal(plan)
    assert why is not None and why.startswith(f"cp=2 with {what}") and "or cp=1" in why
    assert any(r.startswith("context parallel: cp=2") for r in refusals(Request(plan)))


def test_plain_cp_and_dp_cp_are_not_refused() -> None:
    composed = (ParallelPlan(cp=2, pp=1), ParallelPlan(dp=2, cp=2, pp=1, zero=3),
                ParallelPlan(cp=2, pp=2, schedule="zb-v", chunks=2),
                ParallelPlan(cp=2, tp=2, pp=1, sequence_parallel=True))  # fmt: skip
    for plan in composed:
        assert cp_refusal(plan) is None and refusals(Request(plan)) == []
    assert cp_refusal(ParallelPlan(cp=2, pp=1), compile=True) is not None


def test_models_cp_cannot_wire_are_refused_naming_the_module() -> None:
    gpt = GPT(GPTConfig(vocab_size=11, seq_len=8, num_layers=1, hidden=8, num_heads=2))
    check_model({0: gpt}, 2)  # plait's GPT: wired
    check_model({1: gpt.layers[-1]}, 2)  # a last stage holding the head alone
    dropout = GPT(GPTConfig(vocab_size=11, seq_len=8, num_layers=1, hidden=8, num_heads=2,
                            dropout=0.1))  # fmt: skip
    check_model({0: dropout}, 2)  # keyed dropout follows the zigzag split: wired
    with pytest.raises(ValueError, match=r"no causal self-attention .*or cp=1"):
        check_model({0: torch.nn.Linear(2, 2)}, 2)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_attention_dropout_is_refused_naming_the_fix(family: str) -> None:
    pytest.importorskip("transformers")
    from plait.models import hf

    build, config = {
        "gpt2": (hf.gpt2_blocks_model, hf.tiny_gpt2_config),
        "llama": (hf.llama_blocks_model, hf.tiny_llama_config),
    }[family]
    cfg = config(vocab_size=32, seq_len=8)
    check_model({0: build(cfg)}, 2)  # the tiny configs have no dropout: wired as they are
    setattr(cfg, "attn_pdrop" if family == "gpt2" else "attention_dropout", 0.1)
    with pytest.raises(
        ValueError, match=r"cp=2 cannot run \w+Attention .*dropout is 0.1.*set it to 0"
    ):
        check_model({0: build(cfg)}, 2)
