"""`Engine.evaluate` on 4 gloo workers: the loss and a summed metric of a forward-only pass
equal those of one process running the same weights (fp32 to 1e-5; bf16 against one
process under the same autocast, to bf16's precision), under pp, dp, tp, ZeRO and an
asynchronous schedule (whose stream evaluation drains first); evaluation of a synchronous
one changes no weight and no gradient."""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.blocks import equal_split, stage_modules
from plait.cli.main import main
from plait.config import ParallelPlan, TrainConfig
from plait.models import GPT
from plait.train.engine import Engine
from plait.train.parallelize import parallelize
from plait.train.optim import optimizer_factory, scheduler_factory
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

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


def _check(plan: ParallelPlan, size: int | None = None) -> None:
    """Evaluation of a batch (its first `size` samples: any count, not only a multiple of
    dp × microbatches) equals the trained weights' loss and accuracy in one process, and
    changes neither weights nor gradients."""
    model = _model()
    pristine = copy.deepcopy(model)
    engine = parallelize(
        model, plan, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), GPT.loss, device="cpu"
    )
    for step in range(2):  # evaluate trained weights, not the initial ones
        engine.step(_batch(step))
    x, y = _batch(10)
    x, y = x[:size], y[:size]
    before_w, before_g = _weights(engine), _grads(engine)
    report = engine.evaluate((x, y), {"accuracy": _accuracy})
    ref = _reference(pristine, plan, _weights(engine))
    bf16 = plan.dtype == "bf16"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = ref(x)
        loss = GPT.loss(logits, y).float().item()
    where = f"{plan}, {x.shape[0]} samples"
    tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else TOL  # bf16 rounds where stages meet
    torch.testing.assert_close(report.loss, loss, **tol, msg=where)
    expected = (logits.argmax(-1) == y).float().mean(-1).mean().item()
    if not bf16:  # a near-tie may flip an argmax under bf16 rounding
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


def _torch_reference(cfg: TrainConfig, opt: torch.optim.Optimizer, u: int) -> LRScheduler:
    """Warm-up from lr/(w+1) and cosine decay, as torch's schedulers spell them."""
    w, total = cfg.warmup_steps * u, cfg.max_steps * u
    warm = LinearLR(opt, start_factor=1 / (w + 1), end_factor=1.0, total_iters=w)
    decay = CosineAnnealingLR(opt, T_max=total - w, eta_min=cfg.min_lr)
    return SequentialLR(opt, [warm, decay], milestones=[w])


def _schedule_steps_per_update(plan: ParallelPlan) -> None:
    """Each stage's learning rate after every window equals torch's own schedulers
    (`_torch_reference`, on a dummy optimizer) stepped once per update the stage made."""
    cfg = TrainConfig(max_steps=6, lr=0.05, min_lr=0.005, warmup_steps=2, lr_schedule="cosine")
    engine = parallelize(
        _model(), plan, optimizer_factory(cfg), GPT.loss, device="cpu",
        scheduler_factory=scheduler_factory(cfg),
    )  # fmt: skip
    u = max(1, engine.schedule.updates_per_window)
    done = dict.fromkeys(engine.optimizers, 0)
    for s, opt in engine.optimizers.items():
        opt.register_step_post_hook(lambda *_, s=s: done.__setitem__(s, done[s] + 1))
    for step in range(cfg.max_steps):
        engine.step(_batch(step))
        for s, opt in engine.optimizers.items():
            dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
            with warnings.catch_warnings(action="ignore"):
                ref = _torch_reference(cfg, dummy, u)
                for _ in range(done[s]):
                    dummy.step()
                    ref.step()
            for group in opt.param_groups:
                assert math.isclose(group["lr"], dummy.param_groups[0]["lr"], rel_tol=1e-9), (
                    plan,
                    step,
                    s,
                    done[s],
                )
    engine.drain()
    assert all(n > 0 for n in done.values())


def _worker(rank: int, world_size: int) -> None:
    _schedule_steps_per_update(ParallelPlan(pp=2, dp=2, microbatches=2, zero=1))
    _schedule_steps_per_update(ParallelPlan(pp=4, microbatches=4, schedule="2bw"))
    for plan in (
        ParallelPlan(pp=2, dp=2, microbatches=2, schedule="1f1b"),
        ParallelPlan(pp=4, microbatches=4, schedule="gpipe"),
        ParallelPlan(pp=1, tp=2, dp=2, microbatches=2),
        ParallelPlan(pp=2, dp=2, microbatches=2, zero=3),
        ParallelPlan(pp=2, dp=2, microbatches=2, zero=2, dtype="bf16"),
        ParallelPlan(pp=2, tp=2, microbatches=2, schedule="interleaved", chunks=2),
        ParallelPlan(pp=4, microbatches=4, schedule="2bw"),
    ):
        _check(plan)
    for size in (7, 3):  # uneven over dp × microbatches = 4; 3 leaves one replica a sample
        _check(ParallelPlan(pp=2, dp=2, microbatches=2, zero=3), size)


def test_evaluate_equals_a_single_process_forward(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _worker)


SMALL = ["--layers", "2", "--hidden", "64", "--seq-len", "32", "--batch-size", "16",
         "--sample-chars", "0", "--pp", "2"]  # fmt: skip


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_logs_validation_and_resumes_mid_warm_up_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run validates every 2 steps (metrics rows and summary carry `val_loss`); a run
    stopped after 3 of 4 warm-up steps and resumed from its checkpoint logs the very same
    losses, so the schedule went on where it stopped."""
    config = tmp_path / "run.toml"
    config.write_text("warmup_steps = 4\neval_every = 2\neval_batches = 1\nlr = 0.01\n")
    base = ["train", "--config", str(config), *SMALL]
    whole = tmp_path / "whole"
    assert main([*base, "--run-dir", str(whole), "--max-steps", "6"]) == 0
    assert "validation" in capsys.readouterr().out
    rows = _rows(whole)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["step"] for r in rows if "val_loss" in r] == [1, 3, 5]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["val_loss"] == rows[5]["val_loss"]
    parts = tmp_path / "parts"
    again = [*base, "--run-dir", str(parts), "--checkpoint-every", "2"]
    assert main([*again, "--max-steps", "3"]) == 0
    assert main([*again, "--max-steps", "6", "--resume", "auto"]) == 0
    resumed = _rows(parts)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    assert resumed[5]["val_loss"] == rows[5]["val_loss"]
