"""Memory savers on 2 gloo workers, each against one process: activations and optimizer
state offloaded to host memory (pipeline and ZeRO-2 layouts)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.models import GPT
from plait.train.engine import parallelize

from .harness import run_world
from .test_hybrid import TOL, _batch, _full, _model

pytestmark = pytest.mark.dist


def _sgd(ps: object) -> torch.optim.Optimizer:
    # momentum: state to swap; AdamW would turn rounding-level gradient differences of
    # near-zero entries into whole steps of lr
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _offloaded_matches(plan: ParallelPlan, steps: int = 2) -> None:
    """Losses every step and the final weights equal one process's SGD."""
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, _sgd, GPT.loss, device="cpu")
    ref_opt = _sgd(ref.parameters())
    for step in range(steps):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = GPT.loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        report = engine.step((x, y))
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
    ref_blocks = as_blocks(ref)
    for stage in engine.stages.values():
        for j, block in enumerate(stage.blocks):
            theirs = ref_blocks[stage.first_block + j].parameters()
            for p, q in zip(block.parameters(), theirs, strict=True):
                torch.testing.assert_close(_full(p.detach()), q.detach(), **TOL)
    for opt in engine.optimizers.values():  # swapped out after the last step
        for state in opt.state.values():
            assert all(v.device.type == "cpu" for v in state.values())


def _savers(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    # zero-bubble's split backward unpacks the saved tensors in two passes
    _offloaded_matches(
        ParallelPlan(pp=2, microbatches=2, schedule="zb-h1", offload_activations="all",
                     offload_optimizer=True)  # fmt: skip
    )
    _offloaded_matches(
        ParallelPlan(dp=2, pp=1, microbatches=2, zero=2, offload_activations="0,1,2,3",
                     offload_optimizer=True)  # fmt: skip
    )


def test_memory_savers_match_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _savers)
