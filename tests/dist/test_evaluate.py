"""`Engine.evaluate` on 4 gloo workers: the loss and a summed metric of a forward-only pass
equal those of one process running the same weights, under pp, dp, tp, ZeRO and an
asynchronous schedule (whose stream evaluation drains first); evaluation of a synchronous
one changes no weight and no gradient."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.blocks import equal_split, stage_modules
from plait.config import ParallelPlan
from plait.models import GPT
from plait.train.engine import Engine, parallelize

from .harness import run_world
from .test_hybrid import TOL, _batch, _full, _model

pytestmark = pytest.mark.dist


def _accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, the share of its tokens predicted right; summed over the samples."""
    return (_full(logits).argmax(-1) == targets).float().mean(-1).sum()


def _weights(engine: Engine) -> dict[int, dict[str, torch.Tensor]]:
    """Every stage's whole weights, on every rank (a collective)."""
    mine = {
        s: {
            k.replace("_checkpoint_wrapped_module.", ""): _full(t).detach().clone()
            for k, t in m.state_dict().items()
        }
        for s, m in engine.stages.items()
    }
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return {s: state for per_rank in out for s, state in per_rank.items()}


def _grads(engine: Engine) -> list[torch.Tensor | None]:
    return [
        None if p.grad is None else _full(p.grad).clone()
        for m in engine.stages.values()
        for p in m.parameters()
    ]


def _reference(model: GPT, plan: ParallelPlan, weights: dict[int, dict[str, torch.Tensor]]) -> GPT:
    """`model`'s architecture with the engine's trained weights, in one process."""
    ref = copy.deepcopy(model)
    blocks = ref.blocks()
    sizes = plan.partition or equal_split(len(blocks), plan.num_stages)
    for s, stage in enumerate(stage_modules(blocks, sizes)):
        stage.load_state_dict(weights[s])
    return ref.eval()


def _check(plan: ParallelPlan) -> None:
    model = _model()
    pristine = copy.deepcopy(model)
    engine = parallelize(
        model, plan, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), GPT.loss, device="cpu"
    )
    for step in range(2):  # evaluate trained weights, not the initial ones
        engine.step(_batch(step))
    x, y = _batch(10)
    before_w, before_g = _weights(engine), _grads(engine)
    report = engine.evaluate((x, y), {"accuracy": _accuracy})
    ref = _reference(pristine, plan, _weights(engine))
    with torch.no_grad():
        logits = ref(x)
    where = f"{plan}"
    torch.testing.assert_close(report.loss, GPT.loss(logits, y).item(), **TOL, msg=where)
    expected = (logits.argmax(-1) == y).float().mean(-1).mean().item()
    torch.testing.assert_close(report.metrics["accuracy"], expected, **TOL, msg=where)
    assert report.samples == x.shape[0], where
    if not engine.synchronous:  # its stream was drained first: those updates count
        assert report.drained is not None, where
        engine.step(_batch(3))  # a new stream begins after the evaluation
        engine.drain()
        return
    assert report.drained is None, where
    after_w = _weights(engine)
    for s, state in before_w.items():
        for k, t in state.items():
            assert torch.equal(t, after_w[s][k]), f"{where}: evaluation changed {s}.{k}"
    for g0, g1 in zip(before_g, _grads(engine), strict=True):
        assert (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1)), where
    engine.step(_batch(3))  # training goes on after an evaluation
    engine.drain()


def _worker(rank: int, world_size: int) -> None:
    for plan in (
        ParallelPlan(pp=2, dp=2, microbatches=2, schedule="1f1b"),
        ParallelPlan(pp=4, microbatches=4, schedule="gpipe"),
        ParallelPlan(pp=1, tp=2, dp=2, microbatches=2),
        ParallelPlan(pp=2, dp=2, microbatches=2, zero=3),
        ParallelPlan(pp=2, tp=2, microbatches=2, schedule="interleaved", chunks=2),
        ParallelPlan(pp=4, microbatches=4, schedule="2bw"),
    ):
        _check(plan)


def test_evaluate_equals_a_single_process_forward(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _worker)
