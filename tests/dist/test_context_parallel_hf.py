"""The Hugging Face GPT-2 and Llama blocks (Llama with grouped key/value heads and rotary
positions) under cp=2 train to the losses and gradients of the unsplit Hugging Face model
in one plain process, at 1e-5 in fp32."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.train.parallelize import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, SEQ, BATCH = 23, 16, 4


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _check(family: str) -> None:
    from plait.models import hf

    build, config = {
        "gpt2": (hf.gpt2_blocks_model, hf.tiny_gpt2_config),
        "llama": (hf.llama_blocks_model, hf.tiny_llama_config),
    }[family]
    torch.manual_seed(0)
    model = build(config(vocab_size=VOCAB, seq_len=SEQ))
    ref = copy.deepcopy(model)
    plan = ParallelPlan(cp=2, pp=1, microbatches=2)
    engine = parallelize(model, plan, lambda ps: torch.optim.SGD(ps, lr=0.1), model.loss,
                         device="cpu", grad_clip=None)  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_blocks = as_blocks(ref)
    for step in range(2):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = ref.loss(ref(x), y)
        ref_loss.backward()
        report = engine.step((x, y))
        where = f"{family} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        checked = 0
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                theirs = list(ref_blocks[stage.first_block + j].parameters())
                for p, q in zip(block.parameters(), theirs, strict=True):
                    assert p.grad is not None and q.grad is not None, where
                    torch.testing.assert_close(p.grad, q.grad, **TOL, msg=where)
                    checked += 1
        assert checked > 0, where
        ref_opt.step()


def _both(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for family in ("gpt2", "llama"):
        _check(family)


def test_hugging_face_blocks_under_cp2_equal_one_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run_world(tmp_path, 2, _both)
