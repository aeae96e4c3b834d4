"""`compile=True` (torch.compile per block, C++ backend on CPU) against the same references
as the eager engine: every synchronous schedule kind, each ZeRO stage, each recomputation
mode and tensor parallelism against one process on the whole batch at 1e-5 in fp32 (the
asynchronous kinds: tests/dist/test_compile_async.py). One world of two workers runs them
all: blocks of one class and one shape compile once per process, so every check uses
micro-batches of 2 samples of the emulator's 6-layer GPT."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.models import GPT
from plait.schedule import KINDS
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_async_pipeline import _microbatch, _model
from .test_hybrid import TOL, _full

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CHUNKS = {"interleaved": 2, "zb-v": 2}


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _against_one_process(plan: ParallelPlan, steps: int = 2) -> None:
    model, loss_fn = _model("gpt")
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, _sgd, loss_fn, device="cpu", grad_clip=0.5, compile=True)
    ref_opt, ref_blocks = _sgd(ref.parameters()), as_blocks(ref)
    for step in range(steps):
        x, y = _microbatch("gpt", step, 2 * plan.dp * plan.microbatches)
        ref_opt.zero_grad()
        ref_loss = GPT.loss(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        report = engine.step((x, y))
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        assert report.grad_norm == pytest.approx(float(ref_norm), rel=1e-5), where
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                theirs = ref_blocks[stage.first_block + j].parameters()
                for p, q in zip(block.parameters(), theirs, strict=True):
                    torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=where)
        ref_opt.step()


def _every_kind_stage_and_mode(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for name, kind in KINDS.items():
        if kind.synchronous:
            plan = ParallelPlan(pp=2, schedule=name, microbatches=2, chunks=CHUNKS.get(name, 1))
            _against_one_process(plan)
    for zero in (1, 2, 3):
        _against_one_process(ParallelPlan(dp=2, pp=1, microbatches=2, zero=zero))
    for recompute in ("selective", "full"):
        _against_one_process(ParallelPlan(pp=2, microbatches=2, recompute=recompute))
    _against_one_process(ParallelPlan(tp=2, pp=1, microbatches=2))


@pytest.mark.timeout(1200)
def test_compiled_blocks_match_the_references(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _every_kind_stage_and_mode)
