"""Hugging Face GPT-2 and Llama, built from configs with random weights, train through a
pipeline to the same losses and gradients as one process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.train.parallelize import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _hf(rank: int, world: int) -> None:
    from plait.models.hf import (
        gpt2_blocks_model,
        llama_blocks_model,
        tiny_gpt2_config,
        tiny_llama_config,
    )

    for build, config in (
        (gpt2_blocks_model, tiny_gpt2_config),
        (llama_blocks_model, tiny_llama_config),
    ):
        torch.manual_seed(0)
        model = build(config())
        ref = copy.deepcopy(model)
        vocab = model.blocks()[-1].parameters().__next__().shape[0]
        plan = ParallelPlan(dp=1, pp=2, microbatches=2, schedule="1f1b")
        engine = parallelize(
            model, plan, lambda ps: torch.optim.SGD(ps, lr=0.1), model.loss, device="cpu"
        )
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, vocab, (8, 9), generator=g)
            x, y = ids[:, :-1], ids[:, 1:]
            ref_opt.zero_grad()
            ref_loss = ref.loss(ref(x), y)
            ref_loss.backward()
            report = engine.step((x, y))
            torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL)
            ref_blocks = as_blocks(ref)
            for stage in engine.stages.values():
                for j, block in enumerate(stage.blocks):
                    theirs = list(ref_blocks[stage.first_block + j].parameters())
                    for p, q in zip(block.parameters(), theirs, strict=True):
                        torch.testing.assert_close(p.grad, q.grad, **TOL)
            ref_opt.step()


def test_hf_models_match_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _hf)
