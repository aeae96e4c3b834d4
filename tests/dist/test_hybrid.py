"""Every (dp, tp, pp) factorisation of 4 workers, with ZeRO 0-3 and recomputation, trains
the GPT to the losses and gradients of one process on the whole batch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.config import ParallelPlan
from plait.models import GPT, GPTConfig
from plait.train.parallelize import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, SEQ, BATCH = 19, 8, 8


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, hidden=16, num_heads=4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check(
    plan: ParallelPlan,
    steps: int = 2,
    *,
    build: Callable[[], GPT] = lambda: _model(),
    around: Callable[[int], AbstractContextManager[object]] = lambda _step: nullcontext(),
) -> None:
    """`plan` against one process on the whole batch; `around(step)` wraps the reference's
    forward and backward (keyed dropout's step)."""
    model = build()
    ref = copy.deepcopy(model)
    engine = parallelize(
        model,
        plan,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        GPT.loss,
        device="cpu",
        grad_clip=None,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_blocks = as_blocks(ref)
    for step in range(steps):
        x, y = _batch(step)
        ref_opt.zero_grad()
        with around(step):
            ref_loss = GPT.loss(ref(x), y)
            ref_loss.backward()
        report = engine.step((x, y))
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                theirs = list(ref_blocks[stage.first_block + j].parameters())
                for p, q in zip(block.parameters(), theirs, strict=True):
                    assert p.grad is not None, where
                    torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=where)
        ref_opt.step()


FACTORS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def _all_factorisations(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for dp, tp, pp in FACTORS:
        zeros = [0, 1, 2, 3] if dp > 1 else [0]
        for zero in zeros:
            if zero == 1 and tp > 1:
                continue
            # recomputation meets ZeRO where weights are gathered (3) or not at all (0)
            for recompute in ("none", "full") if zero in (0, 3) else ("none",):
                plan = ParallelPlan(
                    dp=dp,
                    tp=tp,
                    pp=pp,
                    microbatches=2,
                    zero=zero,
                    recompute=recompute,
                    schedule="1f1b",
                )
                _check(plan)


def test_every_factorisation_of_four_matches_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _all_factorisations)
