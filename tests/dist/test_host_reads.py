"""A training step reads device values on the host once: the losses, the clipped norm and
fp16's found-inf flag together. Counted by wrapping every way a tensor's value reaches
Python (`item`, `tolist`, `float`, `int`, `bool`), over steps after the first (which
also learns the pipeline's boundary shapes), on 2 pipeline workers; the reports must
still say what one process computes. Reads inside torch's optimizers are not counted:
they read the step counts torch keeps on the host (CPU tensors even beside GPU
parameters), which costs no device sync."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.config import ParallelPlan
from plait.models import GPT
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_hybrid import _batch, _model

pytestmark = pytest.mark.dist

_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextmanager
def _counted() -> Iterator[list[str]]:
    """Every host read of a tensor's value inside the block, by name."""
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not any("torch/optim/" in frame.filename for frame in traceback.extract_stack()):
                seen.append(name)
            return real(self, *args, **kwargs)

        return read

    for name, real in saved.items():
        setattr(torch.Tensor, name, counting(name, real))
    try:
        yield seen
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


def _reads_per_step(dtype: str, impl: dict[str, bool]) -> tuple[list[int], list[Any]]:
    model = _model()
    engine = parallelize(
        model,
        ParallelPlan(pp=2, microbatches=2, dtype=dtype),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, **impl),
        GPT.loss,
        device="cpu",
        grad_clip=0.5,
    )
    reports = [engine.step(_batch(0))]
    counts = []
    for step in (1, 2):
        with _counted() as seen:
            reports.append(engine.step(_batch(step)))
        counts.append(len(seen))
    return counts, reports


def _fp32_reference() -> list[tuple[float, float]]:
    """(loss, clipped norm) of one process over the same three steps."""
    ref = copy.deepcopy(_model())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    out = []
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        loss = GPT.loss(ref(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        out.append((float(loss), float(norm)))
    return out


def _fused_fp16_overflow_is_skipped_on_the_device(rank: int) -> None:
    """One worker overflows: every worker's fused AdamW leaves weights and state as they
    were, the learning-rate schedule does not advance, the scale halves."""
    engine = parallelize(
        _model(),
        ParallelPlan(pp=2, microbatches=2, dtype="fp16"),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        GPT.loss,
        device="cpu",
        grad_clip=0.5,
        scheduler_factory=lambda opt, _: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: k + 1),
    )
    assert engine.scaler is not None
    engine.step(_batch(0))
    (stage,) = engine.stages
    scheduler, optimizer = engine.schedulers[stage], engine.optimizers[stage]
    before = [p.detach().clone() for p in engine.params]
    state = [t.clone() for s in optimizer.state.values() for t in s.values()]
    epoch, scale = scheduler.last_epoch, engine.scaler.scale
    param = next(iter(engine.params))
    handle = param.register_hook(lambda g: g * float("inf")) if rank == 1 else None
    report = engine.step(_batch(1))
    if handle is not None:
        handle.remove()
    assert report.skipped and report.grad_norm is None
    assert engine.scaler.scale == scale / 2 and scheduler.last_epoch == epoch
    assert all(torch.equal(p.detach(), b) for p, b in zip(engine.params, before, strict=True))
    after = [t for s in optimizer.state.values() for t in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, state, strict=True))
    report = engine.step(_batch(2))
    assert not report.skipped and scheduler.last_epoch == epoch + 1
    assert not all(torch.equal(p.detach(), b) for p, b in zip(engine.params, before, strict=True))


def _worker(rank: int, world: int) -> None:
    fp32, reports = _reads_per_step("fp32", {"foreach": True})
    assert fp32 == [1, 1], f"rank {rank}: fp32 read the device {fp32} times per step"
    for report, (loss, norm) in zip(reports, _fp32_reference(), strict=True):
        assert report.loss == pytest.approx(loss, rel=1e-5)
        assert report.grad_norm == pytest.approx(norm, rel=1e-5)
    fused, reports = _reads_per_step("fp16", {"fused": True})
    assert fused == [1, 1], f"rank {rank}: fp16 with fused AdamW read {fused} times per step"
    assert all(r.grad_norm is not None and not r.skipped for r in reports[1:])
    # an optimizer that cannot skip by itself needs the flag before its step
    loop, _ = _reads_per_step("fp16", {"foreach": True})
    assert loop == [2, 2], f"rank {rank}: fp16 with foreach AdamW read {loop} times per step"
    _fused_fp16_overflow_is_skipped_on_the_device(rank)
    dist.barrier()


def test_one_host_read_per_step(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _worker)
