"""Context parallelism (zigzag sequence shards, ring attention) trains plait's GPT to the
losses and gradients of one plain process on the whole sequence: alone, with dp (ZeRO 0-3),
with pp under every synchronous schedule, and with tp (with and without sequence parallelism;
with keyed dropout too)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.checkpoint import CheckpointStore
from plait.config import ParallelPlan
from plait.keyed import drawing
from plait.models import GPT, GPTConfig
from plait.models.moe import MoEConfig, MoEGPT
from plait.train.checkpointing import resume, save
from plait.train.engine import Engine
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
    ref_blocks = as_blocks(ref)
    for step in range(steps):
        x, y = _batch(step)
        ref_opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        report = engine.step((x, y))
        where = f"{plan} step {step} rank {dist.get_rank()}"
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss.detach(), **TOL, msg=where)
        checked = 0
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                theirs = list(ref_blocks[stage.first_block + j].parameters())
                for p, q in zip(block.parameters(), theirs, strict=True):
                    assert p.grad is not None and q.grad is not None, where
                    torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=where)
                    checked += 1
        assert checked > 0, where
        ref_opt.step()


def _two(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _check(ParallelPlan(cp=2, pp=1, microbatches=2, schedule="1f1b"))
    for recompute in ("full", "selective"):  # the ring runs again in backward, in step
        _check(ParallelPlan(cp=2, pp=1, microbatches=2, recompute=recompute))
    _bf16(rank, world)
    moe = MoEGPT(MoEConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, hidden=16, num_heads=2,
                           num_experts=2, top_k=1, moe_every=1))  # fmt: skip
    with pytest.raises(ValueError, match=r"cp=2 with a mixture of experts .*or cp=1"):
        parallelize(moe, ParallelPlan(cp=2, pp=1), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    GPT.loss, device="cpu")  # fmt: skip


def _four(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _check(ParallelPlan(cp=4, pp=1, microbatches=1, schedule="1f1b"))
    for zero in (0, 1, 2, 3):
        _check(ParallelPlan(dp=2, cp=2, pp=1, zero=zero, microbatches=2, schedule="1f1b"))


SYNC = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
        ("zb-v", 2), ("chimera", 1)]  # fmt: skip


def _composed(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for schedule, chunks in SYNC:  # stage boundaries carry the local sequence chunks
        _check(ParallelPlan(pp=2, cp=2, schedule=schedule, chunks=chunks, microbatches=4))
    for sequence_parallel in (False, True):
        _check(ParallelPlan(tp=2, cp=2, pp=1, sequence_parallel=sequence_parallel))
    # keyed dropout with tp × cp: heads, zigzag chunks and sequence-parallel parts at once
    from .test_hybrid import _check as _check_keyed
    from .test_keyed_dropout import SEED
    from .test_keyed_dropout import _model as _dropout_model

    _check_keyed(ParallelPlan(tp=2, cp=2, pp=1, sequence_parallel=True, microbatches=2),
                 build=lambda: _dropout_model(dropout=0.1),
                 around=lambda step: drawing(SEED, step, 0))  # fmt: skip


def _bf16(rank: int, world: int) -> None:
    """cp=2 in bf16 against one process in bf16 (SDPA under the same autocast): both round
    their matmuls to bf16, in other orders, so they agree to bf16's precision only. Stated
    tolerance: the loss within 1e-2 and each gradient within 2e-2 of its norm (seen: < 1e-2),
    but the key bias's, zero up to rounding (softmax ignores a constant per row), within
    1e-5 absolute."""
    torch.use_deterministic_algorithms(True)
    model = _model()
    ref = copy.deepcopy(model)
    plan = ParallelPlan(cp=2, pp=1, microbatches=1, dtype="bf16")
    engine = parallelize(model, plan, lambda ps: torch.optim.SGD(ps, lr=0.1), GPT.loss,
                         device="cpu", grad_clip=None)  # fmt: skip
    x, y = _batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = ref(x)
    ref_loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    ref_loss.backward()
    report = engine.step((x, y))
    assert abs(report.loss - ref_loss.item()) < 1e-2, (report.loss, ref_loss.item())
    (stage,) = engine.stages.values()
    for j, block in enumerate(stage.blocks):
        theirs = dict(as_blocks(ref)[j].named_parameters())
        for name, p in block.named_parameters():
            q = theirs[name]
            assert p.grad is not None and q.grad is not None
            if name == "attn.k.bias":
                torch.testing.assert_close(p.grad, q.grad, rtol=0.0, atol=1e-5)
                continue
            error = (p.grad - q.grad).norm() / q.grad.norm()
            assert error < 2e-2, (rank, j, name, error.item())


def test_cp2_matches_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _two)


def test_dp2_cp2_and_cp4_match_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _four)


def test_pp2_cp2_every_synchronous_schedule_and_tp2_cp2_match_one_process(
    tmp_path: Path,
) -> None:
    run_world(tmp_path, 4, _composed)


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _engine(**plan: object) -> Engine:
    return parallelize(_model(), ParallelPlan(**plan), _sgd, GPT.loss, device="cpu",  # type: ignore[arg-type]
                       grad_clip=None)  # fmt: skip


def _reference_blocks(steps: int) -> list[torch.nn.Module]:
    model = _model()
    opt = _sgd(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        GPT.loss(model(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
    return as_blocks(model)


def _resume_and_step(root: Path, where: str, **plan: object) -> None:
    """Resume the checkpoint of step 2 in `root` under `plan`, run step 3: one process's."""
    engine = _engine(**plan)
    found = resume(engine, CheckpointStore(root), "auto")
    assert found is not None and found.step == 2, where
    engine.step(_batch(2))
    reference = _reference_blocks(3)
    for stage in engine.stages.values():
        for j, block in enumerate(stage.blocks):
            theirs = reference[stage.first_block + j].parameters()
            for p, q in zip(block.parameters(), theirs, strict=True):
                torch.testing.assert_close(_full(p).detach(), q.detach(), **TOL, msg=where)


def _save_two_steps(root: Path, **plan: object) -> None:
    engine = _engine(**plan)
    for step in range(2):
        engine.step(_batch(step))
    store = CheckpointStore(root)
    save(engine, store, 2, {"plan": {}})
    store.wait()


def _across_degrees(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    root = Path(tmp)
    _save_two_steps(root / "cp2", cp=2, pp=1, microbatches=2)
    _resume_and_step(root / "cp2", "cp=2 -> dp=2", dp=2, pp=1, microbatches=2)
    _resume_and_step(root / "cp2", "cp=2 -> pp=2", pp=2, microbatches=2)
    _save_two_steps(root / "dp2", dp=2, pp=1, zero=3, microbatches=2)
    _resume_and_step(root / "dp2", "dp=2 ZeRO-3 -> cp=2", cp=2, pp=1)
    dist.barrier()


def test_checkpoints_resume_across_cp_degrees(tmp_path: Path) -> None:
    """A cp=2 checkpoint resumes under cp=1 (dp=2 or pp=2) and a cp=1 one under cp=2; the
    next step's weights equal one process's."""
    run_world(tmp_path, 2, _across_degrees, str(tmp_path))
