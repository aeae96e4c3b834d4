"""Engine features on 4 gloo workers: mixed precision, fp16 overflow handling, global
gradient clipping, sequence parallelism, selective recomputation, and the other
pipeline schedules under sharded data parallelism, each against one process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.data import SyntheticTokens
from plait.models import GPT, GPTConfig
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_hybrid import TOL, _batch, _full, _model

pytestmark = pytest.mark.dist


def _sgd(ps: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _compare_grads(engine: object, ref: GPT, where: str) -> None:
    ref_blocks = as_blocks(ref)
    for stage in engine.stages.values():  # type: ignore[attr-defined]
        for j, block in enumerate(stage.blocks):
            theirs = list(ref_blocks[stage.first_block + j].parameters())
            for p, q in zip(block.parameters(), theirs, strict=True):
                torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=where)


def _clipped_sequence_parallel(plan: ParallelPlan) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, _sgd, GPT.loss, device="cpu", grad_clip=0.05)
    ref_opt = _sgd(ref.parameters())
    for step in range(2):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = GPT.loss(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        report = engine.step((x, y))
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL)
        assert report.grad_norm == pytest.approx(float(ref_norm), rel=1e-5), where
        _compare_grads(engine, ref, where)
        ref_opt.step()


def _recompute_per_stage() -> None:
    """Each virtual stage recomputes as its entry says, and the step equals one process."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    modes = ("full", "selective", "none", "full")
    plan = ParallelPlan(dp=2, pp=2, microbatches=4, schedule="interleaved", chunks=2,
                        recompute_stages=modes)  # fmt: skip
    engine = parallelize(_model(), plan, _sgd, GPT.loss, device="cpu")
    for s, stage in engine.stages.items():
        wrapped = [isinstance(b, CheckpointWrapper) for b in stage.blocks]
        cores = [m.recompute_core for m in stage.modules() if hasattr(m, "recompute_core")]
        assert all(wrapped) == (modes[s] == "full") and any(wrapped) == all(wrapped), (s, wrapped)
        assert (any(cores) and all(cores)) == (modes[s] == "selective"), (s, cores)
    _clipped_sequence_parallel(plan)


def _bf16_loss_falls() -> None:
    data = SyntheticTokens(vocab=32, seq_len=16, size=512, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=16, num_layers=2, hidden=32, num_heads=4))
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, dtype="bf16")
    engine = parallelize(
        model,
        plan,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        GPT.loss,
        device="cpu",
        grad_clip=1.0,
    )
    losses = [engine.step(data.batch(step, 16)).loss for step in range(25)]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def _fp16_overflow_is_skipped() -> None:
    model = _model()
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, dtype="fp16")
    engine = parallelize(model, plan, _sgd, GPT.loss, device="cpu")
    assert engine.scaler is not None
    scale = engine.scaler.scale
    param = next(iter(engine.stages.values())).blocks[0].parameters().__next__()
    before = [p.detach().clone() for p in engine.params]
    handle = None
    if dist.get_rank() == 3:  # one worker overflows; every worker must skip
        handle = param.register_hook(lambda g: g * float("inf"))
    report = engine.step(_batch(0))
    if handle is not None:
        handle.remove()
    assert report.skipped
    assert engine.scaler.scale == scale / 2 and engine.scaler.skipped == 1
    for p, b in zip(engine.params, before, strict=True):
        assert torch.equal(p.detach(), b), "a skipped step changed the weights"
    report = engine.step(_batch(1))
    assert not report.skipped and report.loss == report.loss  # finite, not NaN
    assert any(not torch.equal(p.detach(), b) for p, b in zip(engine.params, before, strict=True))


def _zero1_adamw_matches() -> None:
    """ZeRO-1 shards AdamW's state; the weights after each step equal one process's."""
    model = _model()
    ref = copy.deepcopy(model)
    plan = ParallelPlan(dp=2, pp=2, microbatches=2, zero=1)

    def adamw(ps: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # type: ignore[arg-type]

    engine = parallelize(model, plan, adamw, GPT.loss, device="cpu")
    ref_opt = adamw(ref.parameters())
    for step in range(3):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = GPT.loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        report = engine.step((x, y))
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL)


def _features(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for plan in [
        ParallelPlan(
            dp=1, tp=2, pp=2, microbatches=2, sequence_parallel=True, recompute="selective"
        ),
        ParallelPlan(dp=2, tp=1, pp=2, microbatches=4, schedule="zb-h1", zero=3),
        ParallelPlan(
            dp=2,
            tp=1,
            pp=2,
            microbatches=4,
            schedule="interleaved",
            chunks=2,
            zero=2,
            recompute="full",
        ),
        ParallelPlan(dp=2, tp=2, pp=1, microbatches=2, zero=3, sequence_parallel=True),
        ParallelPlan(dp=2, tp=1, pp=2, microbatches=4, schedule="zb-h1", zero=0),
        ParallelPlan(dp=2, tp=1, pp=2, microbatches=2, schedule="gpipe", zero=1),
    ]:
        _clipped_sequence_parallel(plan)
    _recompute_per_stage()
    _zero1_adamw_matches()
    _bf16_loss_falls()
    _fp16_overflow_is_skipped()


def test_engine_features_match_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _features)
