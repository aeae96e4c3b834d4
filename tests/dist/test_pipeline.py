"""Every pipeline schedule trains to the losses and gradients of one process on the batch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from plait.blocks import as_blocks
from plait.models import GPT, GPTConfig, SkipMLP
from plait.runtime import PipelineExecutor, local_stages, split_microbatches
from plait.schedule import build

from . import pipeline_shapes
from .harness import run_world

pytestmark = pytest.mark.dist

STEPS = 2  # the second on updated weights and momentum
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _gpt() -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=23, seq_len=8, num_layers=6, hidden=16, num_heads=2))
    return model, GPT.loss


def _skip() -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    return SkipMLP(dim=6, hidden=10, classes=4, num_blocks=8), SkipMLP.loss


def _batch(name: str, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if name == "gpt":
        ids = torch.randint(0, 23, (batch, 9), generator=g)
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g)


def _check(rank: int, world: int, kind: str, chunks: int, m: int, name: str) -> None:
    make = _gpt if name == "gpt" else _skip
    model, loss_fn = make()
    ref = copy.deepcopy(model)
    schedule = build(kind, world, m, chunks)
    stages = local_stages(model, schedule, rank)
    executor = PipelineExecutor(schedule, stages, rank=rank, loss_fn=loss_fn)
    params = [p for s in stages.values() for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_blocks = as_blocks(ref)
    for step in range(STEPS):
        x, y = _batch(name, step, 2 * m)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        opt.zero_grad()
        result = executor.step(
            split_microbatches(x, m) if 0 in stages else None,
            split_microbatches(y, m) if schedule.num_stages - 1 in stages else None,
        )
        where = f"{kind} chunks={chunks} m={m} {name} step {step} rank {rank}"
        if result.loss is not None:
            torch.testing.assert_close(result.loss, ref_loss.detach(), **TOL, msg=where)
        for stage in stages.values():
            for j, block in enumerate(stage.blocks):
                mine = list(block.named_parameters())
                theirs = list(ref_blocks[stage.first_block + j].parameters())
                for (pname, p), q in zip(mine, theirs, strict=True):
                    assert p.grad is not None, f"{where}: {pname} got no gradient"
                    torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"{where} {pname}")
        opt.step()
        ref_opt.step()


CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def _labels_under_profiler(rank: int, world: int) -> None:
    """Each executed action is labelled `PP:<action>` for the profiler (and only then)."""
    model, loss_fn = _skip()
    schedule = build("1f1b", world, 2)
    stages = local_stages(model, schedule, rank)
    executor = PipelineExecutor(schedule, stages, rank=rank, loss_fn=loss_fn)
    x, y = _batch("skip", 0, 4)
    args = (
        split_microbatches(x, 2) if 0 in stages else None,
        split_microbatches(y, 2) if schedule.num_stages - 1 in stages else None,
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = executor.step(*args)
    names = {e.name for e in prof.events()}
    assert {f"PP:{a}" for a in schedule.ranks[rank]} <= names
    assert [r.label for r in result.records] == [str(a) for a in schedule.ranks[rank]]


def _all_schedules(rank: int, world: int, microbatches: tuple[int, ...]) -> None:
    _labels_under_profiler(rank, world)
    for kind, chunks in CASES:
        for m in microbatches:
            for name in ("gpt", "skip"):
                _check(rank, world, kind, chunks, m, name)
    # the shapes that run through the engine (ZB-H2, ZB-V, Chimera), in the same world
    pipeline_shapes.two() if world == 2 else pipeline_shapes.four()


def test_two_ranks_match_single_process(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _all_schedules, (1, 3))


def test_four_ranks_match_single_process(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _all_schedules, (5,))
