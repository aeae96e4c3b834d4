"""Memory savers and re-partitioning on 2 gloo workers, each against one process:
activations and optimizer state offloaded to host memory, and blocks moved between the
pipeline ranks mid-run."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.models import GPT
from plait.train.engine import Engine
from plait.train.parallelize import parallelize
from plait.train.optim import param_groups
from plait.train.repartition import Repartitioner

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


def _halving(
    optimizer: torch.optim.Optimizer, updates: int
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5**k)


def _grouped(ps: object) -> torch.optim.Optimizer:
    # two groups (matrices decayed), one where a stage holds only the embedding
    groups = param_groups(ps, 0.1)  # type: ignore[arg-type]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _repartition_matches() -> None:
    """Blocks move at steps 1 and 2 (weights, momentum, the schedule's position): losses,
    weights and momentum equal one process's run without any move."""
    model = _model()
    ref = copy.deepcopy(model)

    def build(plan: ParallelPlan) -> Engine:
        return parallelize(model, plan, _grouped, GPT.loss, device="cpu",
                           scheduler_factory=_halving)  # fmt: skip

    engine = build(ParallelPlan(pp=2, microbatches=2, partition=(2, 2)))
    mover = Repartitioner(model, build)
    ref_opt = _grouped(ref.parameters())
    ref_lr = _halving(ref_opt, 1)
    for step, sizes in enumerate([(1, 3), (3, 1), None]):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = GPT.loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_lr.step()
        report = engine.step((x, y))
        where = f"step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        if sizes is not None:
            engine = mover.move(engine, sizes, step)
            assert engine.plan.partition == sizes
    assert [sizes for _, sizes in mover.moves] == [(1, 3), (3, 1)]
    ref_blocks = as_blocks(ref)
    for s, stage in engine.stages.items():
        for j, block in enumerate(stage.blocks):
            theirs = ref_blocks[stage.first_block + j].parameters()
            for p, q in zip(block.parameters(), theirs, strict=True):
                torch.testing.assert_close(p.detach(), q.detach(), **TOL)
                momentum = engine.optimizers[s].state[p]["momentum_buffer"]
                torch.testing.assert_close(momentum, ref_opt.state[q]["momentum_buffer"], **TOL)
        assert engine.optimizers[s].param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def _savers(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    # zero-bubble's split backward unpacks the saved tensors in two passes
    _offloaded_matches(
        ParallelPlan(
            pp=2,
            microbatches=2,
            schedule="zb-h1",
            offload_activations="all",
            offload_optimizer=True,
        )  # fmt: skip
    )
    _repartition_matches()


def test_memory_savers_and_repartitioning_match_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _savers)
