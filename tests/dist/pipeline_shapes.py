"""ZB-H2, ZB-V (stages in a V) and Chimera (two opposite pipelines of replicated parts) on 2
and 4 gloo processes train the GPT to the losses, gradients and weights of one process
on the whole batch; Chimera's two replicas of every part stay identical. Run inside
test_pipeline's worlds (`two`, `four`), which spares starting two more."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.models import GPT, GPTConfig
from plait.train.engine import Engine
from plait.train.parallelize import parallelize

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, SEQ, BATCH = 19, 8, 8
CLIP = 0.5  # small enough to clip: the norm must count each part once


def _model(parts: int) -> GPT:
    """The smallest GPT with a block per part (embedding and head are blocks too)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=max(1, parts - 2), hidden=16,
                       num_heads=4)  # fmt: skip
    return GPT(config)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _check(plan: ParallelPlan) -> None:
    """Two steps (the second on momentum and updated weights) for Chimera, whose replicas
    must stay identical; one for the others."""
    steps = 2 if plan.schedule == "chimera" else 1
    model = _model(plan.num_stages)
    ref = copy.deepcopy(model)
    engine = parallelize(
        model,
        plan,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        GPT.loss,
        device="cpu",
        grad_clip=CLIP,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_blocks = as_blocks(ref)
    for step in range(steps):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = GPT.loss(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        report = engine.step((x, y))
        ref_opt.step()
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        assert report.grad_norm == pytest.approx(float(ref_norm), rel=1e-5), where
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                theirs = list(ref_blocks[stage.first_block + j].parameters())
                for p, q in zip(block.parameters(), theirs, strict=True):
                    assert p.grad is not None, where
                    torch.testing.assert_close(p.grad, q.grad, **TOL, msg=where)
                    torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=where)
    if plan.schedule == "chimera":
        _replicas_identical(engine)


def _replicas_identical(engine: Engine) -> None:
    """Both replicas of every part hold bit-identical weights (gathered from every rank)."""
    mine = {s: [p.detach() for p in m.parameters()] for s, m in engine.stages.items()}
    gathered: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    by_stage = {s: ps for per_rank in gathered for s, ps in per_rank.items()}
    for k in range(engine.schedule.num_parts):
        first, *others = engine.schedule.replicas(k)
        assert others, f"part {k} has a single replica"
        for other in others:
            for a, b in zip(by_stage[first], by_stage[other], strict=True):
                assert torch.equal(a, b), f"part {k}: stages {first} and {other} differ"


def two() -> None:
    torch.use_deterministic_algorithms(True)
    for schedule, chunks, m in [("zb-h2", 1, 4), ("zb-v", 2, 4), ("chimera", 1, 4)]:
        _check(ParallelPlan(pp=2, schedule=schedule, chunks=chunks, microbatches=m))


def four() -> None:
    torch.use_deterministic_algorithms(True)
    for schedule, chunks, m in [("zb-h2", 1, 8), ("zb-v", 2, 8), ("chimera", 1, 8)]:
        _check(ParallelPlan(pp=4, schedule=schedule, chunks=chunks, microbatches=m))
    # the replica sums over the data-parallel average
    _check(ParallelPlan(dp=2, pp=2, schedule="chimera", microbatches=2))
