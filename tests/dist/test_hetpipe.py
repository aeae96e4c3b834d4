"""Heterogeneous pipelines (HetPipe's virtual workers) on 4 gloo workers: synchronous
plans (a 1-rank and a 3-rank pipeline; two 2-rank pipelines cut differently) with
different micro-batch counts train like one process on the whole batch; WSP (D = 1, 2) and SSP (4 one-rank workers) end with the
weights of a single-process emulator of the wave rule written here; SSP "at most D"
(timing-dependent) stays within D and ends on the same weights everywhere."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan, PipelineSpec
from plait.models import GPT, GPTConfig
from plait.train.parallelize import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, SEQ, BATCH, LR = 19, 8, 12, 0.1
# pipeline 0: the whole model on rank 0, 2 micro-batches; pipeline 1: ranks 1-3, 4 of them
PIPELINES = (PipelineSpec(partition=(4,), microbatches=2),
             PipelineSpec(partition=(1, 2, 1), microbatches=4))  # fmt: skip


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, hidden=16, num_heads=4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)  # type: ignore[arg-type]


def _assert_blocks(engine: object, ref: torch.nn.Module, where: str) -> None:
    ref_blocks = as_blocks(ref)
    for stage in engine.stages.values():  # type: ignore[attr-defined]
        for j, block in enumerate(stage.blocks):
            theirs = dict(ref_blocks[stage.first_block + j].named_parameters())
            for name, p in block.named_parameters():
                torch.testing.assert_close(p.detach(), theirs[name].detach(), **TOL,
                                           msg=f"{where} block {stage.first_block + j} {name}")  # fmt: skip


def _synchronous(plan: ParallelPlan) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, _sgd, GPT.loss, device="cpu", grad_clip=0.5)
    ref_opt = _sgd(ref.parameters())
    for step in range(3):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = GPT.loss(ref(x), y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        report = engine.step((x, y))
        where = f"synchronous {plan.pipelines} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        _assert_blocks(engine, ref, where)


def _emulate(
    workers: int, shares: list[tuple[int, int]], staleness: int, wave: int, steps: int
) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """The wave rule on one process: worker i trains on rows shares[i] of each batch with
    its own SGD; before wave c it adds the other workers' updates of waves <= c - D - 1;
    the global weights are w0 plus every wave update. (workers' weights, global)"""
    w0 = _model()
    models = [copy.deepcopy(w0) for _ in range(workers)]
    opts = [_sgd(m.parameters()) for m in models]
    sums: list[list[list[torch.Tensor]]] = [[] for _ in range(workers)]  # [i][wave][param]
    applied = [0] * workers  # waves of the others taken in
    start: list[list[torch.Tensor]] = [[] for _ in range(workers)]

    def take_in(i: int, upto: int) -> None:
        for c in range(applied[i], upto):
            with torch.no_grad():
                for j in range(workers):
                    if j != i:
                        for p, u in zip(models[i].parameters(), sums[j][c], strict=True):
                            p.add_(u)
        applied[i] = max(applied[i], upto)

    for step in range(steps):
        x, y = _batch(step)
        c = step // wave
        for i, (first, count) in enumerate(shares):
            if step % wave == 0:
                take_in(i, c - staleness)
                start[i] = [p.detach().clone() for p in models[i].parameters()]
            opts[i].zero_grad()
            GPT.loss(models[i](x[first : first + count]), y[first : first + count]).backward()
            opts[i].step()
            if (step + 1) % wave == 0 or step + 1 == steps:
                sums[i].append([p.detach() - s for p, s in zip(models[i].parameters(), start[i],
                                                               strict=True)])  # fmt: skip
    final = copy.deepcopy(w0)
    with torch.no_grad():
        for i in range(workers):
            for c in range(len(sums[i])):
                for p, u in zip(final.parameters(), sums[i][c], strict=True):
                    p.add_(u)
    return models, final


def _wsp(plan: ParallelPlan, shares: list[tuple[int, int]], steps: int) -> None:
    assert plan.wsp_staleness is not None
    engine = parallelize(_model(), plan, _sgd, GPT.loss, device="cpu")
    models, final = _emulate(len(shares), shares, plan.wsp_staleness, plan.wsp_wave, steps)
    for step in range(steps):
        engine.step(_batch(step))
    where = f"D={plan.wsp_staleness} wave={plan.wsp_wave} rank {dist.get_rank()}"
    _assert_blocks(engine, models[engine.groups.pipeline], f"{where} before the last exchange")
    engine.finish()
    _assert_blocks(engine, final, f"{where} global weights")


def _all(rank: int, world: int) -> None:
    _synchronous(ParallelPlan(dp=2, pp=1, microbatches=2, pipelines=PIPELINES))
    # two pipelines of one depth, cut differently, on ranks (0, 2) and (1, 3) (tp-dp-pp)
    same_depth = (PipelineSpec(partition=(3, 1), microbatches=4),
                  PipelineSpec(partition=(1, 3), microbatches=2))  # fmt: skip
    _synchronous(ParallelPlan(dp=2, pp=2, microbatches=4, pipelines=same_depth))
    hetero = [(0, 4), (4, 8)]  # rows of each pipeline: 2 and 4 micro-batches of 2
    for staleness, wave in ((1, 2), (2, 1)):
        plan = ParallelPlan(dp=2, pp=1, microbatches=2, pipelines=PIPELINES,
                            wsp_staleness=staleness, wsp_wave=wave)  # fmt: skip
        _wsp(plan, hetero, steps=5)
    ssp = ParallelPlan(dp=4, pp=1, microbatches=1, wsp_staleness=1)  # one rank per worker
    _wsp(ssp, [(3 * i, 3) for i in range(4)], steps=4)
    _at_most(dataclasses.replace(ssp, wsp_at_most=True), steps=4)


def _at_most(plan: ParallelPlan, steps: int) -> None:
    """ "At most D" depends on timing: what is checked is that it trains, that no wave
    starts more than D waves behind, and that every worker ends on the same global weights."""
    engine = parallelize(_model(), plan, _sgd, GPT.loss, device="cpu")
    for step in range(steps):
        engine.step(_batch(step))
    lags = engine.waves.lags
    assert len(lags) == steps and max(lags) <= (plan.wsp_staleness or 0), lags
    engine.finish()
    flat = torch.cat([p.detach().flatten() for s in engine.stages.values() for p in s.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    torch.testing.assert_close(low, high, **TOL, msg="at most D: global weights differ")


def test_hetero_pipelines_and_wsp(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _all)
