"""Context parallelism (zigzag sequence shards, ring attention) trains plait's GPT to the
losses and gradients of one plain process on the whole sequence, alone and with dp."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.config import ParallelPlan
from plait.models import GPT, GPTConfig
from plait.train.parallelize import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, SEQ, BATCH = 23, 16, 4


def _model(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, hidden=16, num_heads=2,
                    dropout=dropout)  # fmt: skip
    return GPT(cfg)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check(plan: ParallelPlan, steps: int = 2) -> None:
    """`plan` against one plain process (SDPA on the whole sequence), step by step."""
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                         GPT.loss, device="cpu", grad_clip=None)  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        report = engine.step((x, y))
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        (stage,) = engine.stages.values()
        names = dict(stage.named_parameters())
        assert len(names) == len(ref_params), where
        for name, p in names.items():
            q = ref_params[_ref_name(name)]
            assert p.grad is not None and q.grad is not None, f"{where} {name}"
            torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=f"{where} {name}")
        ref_opt.step()


def _ref_name(name: str) -> str:
    """The reference GPT's name of a stage parameter (`blocks.i.` → `layers.i.`)."""
    parts = name.split(".")
    return ".".join(["layers", *parts[1:]]) if parts[0] == "blocks" else name


def _two(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _check(ParallelPlan(cp=2, pp=1, microbatches=2, schedule="1f1b"))
    with pytest.raises(ValueError, match=r"cp=2 with dropout=0.1 .*use dropout=0"):
        parallelize(_model(dropout=0.1), ParallelPlan(cp=2, pp=1),
                    lambda ps: torch.optim.SGD(ps, lr=0.1), GPT.loss, device="cpu")  # fmt: skip


def _four(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _check(ParallelPlan(cp=4, pp=1, microbatches=1, schedule="1f1b"))
    for zero in (0, 1, 2, 3):
        _check(ParallelPlan(dp=2, cp=2, pp=1, zero=zero, microbatches=2, schedule="1f1b"))


def test_cp2_matches_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _two)


def test_dp2_cp2_and_cp4_match_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _four)
