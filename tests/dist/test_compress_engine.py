"""Training with a compressed data-parallel reduction: `ParallelPlan(compress=...)`
through `parallelize`, against one process that emulates the method on each replica's
gradients (threshold quantisation with error feedback, Ström 2015), alone and under a
pipeline; fp16 under ZeRO-2 against the plain average at fp16's tolerance."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.models import GPT
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_hybrid import BATCH, _batch, _full, _model

pytestmark = pytest.mark.dist

TAU, STEPS = 0.004, 3


def _replica_grads(ref: GPT, step: int, dp: int) -> list[list[torch.Tensor]]:
    """Each data-parallel replica's gradient: the loss on its contiguous share of the batch."""
    x, y = _batch(step)
    share = BATCH // dp
    out = []
    for r in range(dp):
        ref.zero_grad()
        GPT.loss(ref(x[r * share : (r + 1) * share]), y[r * share : (r + 1) * share]).backward()
        out.append([p.grad.detach().clone() for p in ref.parameters()])  # type: ignore[union-attr]
    return out


def _threshold(plan: ParallelPlan) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, lambda ps: torch.optim.SGD(ps, lr=0.5), GPT.loss,
                         device="cpu")  # fmt: skip
    residual = [[torch.zeros_like(p) for p in ref.parameters()] for _ in range(plan.dp)]
    ref_blocks = as_blocks(ref)
    index = {id(p): i for i, p in enumerate(ref.parameters())}
    sent_any = False
    for step in range(STEPS):
        grads = _replica_grads(ref, step, plan.dp)
        mean = []
        for i in range(len(grads[0])):
            sent = []
            for r in range(plan.dp):
                residual[r][i] += grads[r][i]
                s = TAU * ((residual[r][i] >= TAU).float() - (residual[r][i] <= -TAU).float())
                residual[r][i] -= s
                sent.append(s)
            mean.append(sum(sent) / plan.dp)
            sent_any |= bool(mean[-1].abs().sum() > 0)
        engine.step(_batch(step))
        where = f"{plan} step {step} rank {dist.get_rank()}"
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                for p, q in zip(
                    block.parameters(), ref_blocks[stage.first_block + j].parameters(), strict=True
                ):
                    expected = mean[index[id(q)]]
                    torch.testing.assert_close(
                        _full(p.grad), expected, rtol=1e-5, atol=1e-5, msg=where
                    )  # type: ignore[arg-type]
        with torch.no_grad():
            for p, g in zip(ref.parameters(), mean, strict=True):
                p -= 0.5 * g
    assert sent_any, "tau too large: nothing was sent, the test would prove nothing"


def _fp16_zero2(plan: ParallelPlan) -> None:
    """Each replica's gradient rounded to fp16, then averaged (what the reduce-scatter
    in fp16 computes, up to the order of its additions)."""
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, lambda ps: torch.optim.SGD(ps, lr=0.5), GPT.loss,
                         device="cpu")  # fmt: skip
    ref_blocks = as_blocks(ref)
    index = {id(p): i for i, p in enumerate(ref.parameters())}
    for step in range(STEPS):
        grads = _replica_grads(ref, step, plan.dp)
        mean = [sum(g[i].half().float() for g in grads) / plan.dp for i in range(len(grads[0]))]
        engine.step(_batch(step))
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                for p, q in zip(
                    block.parameters(), ref_blocks[stage.first_block + j].parameters(), strict=True
                ):
                    # a few fp16 ulps (2^-11 relative, ~1e-5 at the largest entries) from
                    # FSDP2 dividing before and after the sum, and its order
                    expected = mean[index[id(q)]]
                    got = _full(p.grad).float()  # type: ignore[union-attr, arg-type]
                    torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-5)
                    # and it went over the wire in fp16: every value is an fp16 value
                    assert torch.equal(got, got.half().float())
        with torch.no_grad():  # the next step starts from the engine's weights: no drift
            for stage in engine.stages.values():
                for j, block in enumerate(stage.blocks):
                    theirs = ref_blocks[stage.first_block + j].parameters()
                    for p, q in zip(block.parameters(), theirs, strict=True):
                        q.copy_(_full(p))


def _two(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _threshold(ParallelPlan(dp=2, pp=1, microbatches=2, compress=f"threshold:{TAU}"))
    _fp16_zero2(ParallelPlan(dp=2, pp=1, microbatches=1, zero=2, compress="fp16"))


def _four(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _threshold(ParallelPlan(dp=2, pp=2, microbatches=2, compress=f"threshold:{TAU}"))


def test_compressed_training_matches_the_method_emulated(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _two)
    run_world(tmp_path, 4, _four)


def test_settings_that_cannot_apply_are_errors() -> None:
    with pytest.raises(ValueError, match="dp=1: there is no data-parallel reduction"):
        ParallelPlan(dp=1, compress="fp16")
    with pytest.raises(ValueError, match="ZeRO-2/3 reduce by FSDP2"):
        ParallelPlan(dp=2, zero=3, compress="sign")
    with pytest.raises(ValueError, match="unknown method"):
        ParallelPlan(dp=2, compress="zip")
