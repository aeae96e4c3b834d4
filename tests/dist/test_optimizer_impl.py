"""The optimizers `optimizer_impl` builds (fused, foreach, loop; AdamW and SGD) train the
same weights as a plain torch optimizer in one process, under the layouts that change what
they hold: tensor parallelism (plain and DTensor parameters in one stage), ZeRO-1
(torch's ZeroRedundancyOptimizer around them) and ZeRO-3 (FSDP's DTensor shards; fused SGD
has no DTensor rule there and falls back)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan, TrainConfig
from plait.models import GPT
from plait.train.parallelize import parallelize
from plait.train.optim import optimizer_factory

from .harness import run_world
from .test_hybrid import TOL, _batch, _full, _model

pytestmark = pytest.mark.dist


def _reference(model: GPT, cfg: TrainConfig) -> torch.optim.Optimizer:
    """torch's own optimizer, as one writes it: decay on matrices only, a loop per tensor."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=False)
    return torch.optim.AdamW(groups, lr=cfg.lr, eps=cfg.eps, foreach=False)


def _check(plan: ParallelPlan, cfg: TrainConfig) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, optimizer_factory(cfg), GPT.loss, device="cpu")
    ref_opt, ref_blocks = _reference(ref, cfg), as_blocks(ref)
    for step in range(2):
        x, y = _batch(step)
        ref_opt.zero_grad()
        GPT.loss(ref(x), y).backward()
        ref_opt.step()
        engine.step((x, y))
    where = f"{plan} {cfg.optimizer} {cfg.optimizer_impl} rank {dist.get_rank()}"
    for stage in engine.stages.values():
        for j, block in enumerate(stage.blocks):
            theirs = ref_blocks[stage.first_block + j].parameters()
            for p, q in zip(block.parameters(), theirs, strict=True):
                torch.testing.assert_close(_full(p.detach()), q.detach(), **TOL, msg=where)


def _layouts(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    plans = [
        ParallelPlan(tp=2, pp=1, microbatches=1),
        ParallelPlan(dp=2, pp=1, microbatches=1, zero=1),
        ParallelPlan(dp=2, pp=1, microbatches=1, zero=3),
    ]
    for plan in plans:
        for impl in ("fused", "foreach"):
            _check(plan, TrainConfig(optimizer_impl=impl, lr=1e-2, eps=1e-4))
        _check(plan, TrainConfig(optimizer="sgd", momentum=0.9, optimizer_impl="fused", lr=0.1))


def test_every_implementation_matches_torch_in_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _layouts)
