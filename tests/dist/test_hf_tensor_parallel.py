"""Tensor parallelism on Hugging Face Llama layers: a tp=2 (and tp=2 × pp=2) run computes
the losses and gradients of one process; GPT-2's fused attention is refused clearly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from plait.blocks import as_blocks
from plait.config import ParallelPlan, load_config
from plait.train.engine import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _llama_tp(rank: int, world: int, pp: int) -> None:
    from plait.models.hf import llama_blocks_model, tiny_llama_config

    torch.manual_seed(0)
    model = llama_blocks_model(tiny_llama_config(num_layers=2, hidden=32, num_heads=4,
                                                 num_kv_heads=2))  # fmt: skip
    ref = copy.deepcopy(model)
    plan = ParallelPlan(dp=1, tp=world // pp, pp=pp, microbatches=2)
    engine = parallelize(model, plan, lambda ps: torch.optim.SGD(ps, lr=0.1), model.loss,
                         device="cpu")  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_blocks = as_blocks(ref)
    for step in range(2):
        ids = torch.randint(0, 128, (4, 9), generator=torch.Generator().manual_seed(step))
        x, y = ids[:, :-1], ids[:, 1:]
        ref_opt.zero_grad()
        ref_loss = ref.loss(ref(x), y)
        ref_loss.backward()
        report = engine.step((x, y))
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL)
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                theirs = dict(ref_blocks[stage.first_block + j].named_parameters())
                for name, p in block.named_parameters():
                    torch.testing.assert_close(_whole(p.grad), theirs[name].grad, **TOL)
        ref_opt.step()
        for stage in engine.stages.values():  # the engine updated inside its step
            for j, block in enumerate(stage.blocks):
                theirs = dict(ref_blocks[stage.first_block + j].named_parameters())
                for name, p in block.named_parameters():
                    torch.testing.assert_close(_whole(p).detach(), theirs[name].detach(), **TOL)


@pytest.mark.parametrize("pp", [1, 2])
def test_llama_layers_under_tensor_parallelism_match_one_process(tmp_path: Path, pp: int) -> None:
    run_world(tmp_path, 2 * pp, _llama_tp, pp)


def test_tensor_parallel_hf_configs_are_checked_before_workers_start() -> None:
    with pytest.raises(ValueError, match="'hf-gpt2': its layers have no tensor-parallel plan"):
        load_config(**{"model.name": "hf-gpt2", "data": "synthetic", "parallel.tp": 2})
    with pytest.raises(ValueError, match="tp=4 must divide hf-llama's 2 key-value heads"):
        load_config(**{"model.name": "hf-llama", "data": "synthetic", "parallel.tp": 4,
                       "parallel.pp": 1})  # fmt: skip
