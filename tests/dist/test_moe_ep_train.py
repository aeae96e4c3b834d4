"""`plait train --model moe-gpt --ep E` against one process: experts spread over ep of the
data-parallel ranks, alone, with expert replicas (dp > ep) and under a 1F1B and a
zero-bubble pipeline (whose input half of each backward holds the all-to-all's).

Under expert parallelism each rank's router sees only its own micro-batch, so capacity
and the load-balancing loss count one micro-batch's tokens: exactly what one process
computes when it runs the model on each data-parallel rank's micro-batch separately and
averages the losses. Every expert tensor is saved whole ([experts, ...]) under its global
name, so the checkpoints' exported weights give each step's update (-LR × the gradient)
of every parameter, expert slices included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from plait.cli.main import main

from .test_moe_train import BATCH, LR, STEPS, exported_weights, sgd_reference

pytestmark = pytest.mark.dist

AUX, Z, M = 0.5, 0.05, 2  # STEPS, BATCH and LR are test_moe_train.py's
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _args(capacity: float) -> list[str]:
    # every layer a MoE layer; plain SGD without clipping or decay: each update is -LR × grad
    return ["--model", "moe-gpt", "--data", "synthetic", "--layers", "2", "--hidden", "64",
            "--seq-len", "32", "--batch-size", str(BATCH), "--moe-every", "1",
            "--capacity-factor", str(capacity), "--aux-loss-coef", str(AUX),
            "--z-loss-coef", str(Z), "--optimizer", "sgd", "--lr", str(LR),
            "--weight-decay", "0", "--grad-clip", "0", "--max-steps", str(STEPS),
            "--checkpoint-every", "1", "--microbatches", str(M)]  # fmt: skip


def _model(capacity: float) -> torch.nn.Module:
    from plait.models import MoEConfig, MoEGPT

    torch.manual_seed(0)  # the run's seed
    cfg = MoEConfig(vocab_size=64, seq_len=32, num_layers=2, hidden=64, num_heads=4,
                    num_experts=4, top_k=2, capacity_factor=capacity or None, moe_every=1,
                    aux_loss_coef=AUX, z_loss_coef=Z)  # fmt: skip
    return MoEGPT(cfg)


def _reference(pieces: int, capacity: float) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses and gradients of each step in one process, with every expert: the mean over
    the `pieces` consecutive parts of the batch (dp ranks × micro-batches), each routed on
    its own, of cross-entropy + router losses."""
    return sgd_reference(_model(capacity), pieces)


def _check_run(run_dir: Path, tmp_path: Path, dp: int, capacity: float) -> None:
    losses, grads = _reference(dp * M, capacity)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got = torch.tensor([r["loss"] for r in rows])
    torch.testing.assert_close(got, torch.tensor(losses), **TOL)
    before = _model(capacity).state_dict()
    for step in range(STEPS):
        after = exported_weights(run_dir, step + 1, tmp_path)
        assert set(after) == set(grads[step])
        for name, g in grads[step].items():
            torch.testing.assert_close((before[name] - after[name]) / LR, g, **TOL, msg=name)
        before = after


# (layout, capacity factor: 1.0 drops tokens, 0 is dropless)
LAYOUTS = [
    (["--dp", "2", "--pp", "1", "--ep", "2"], 1.0),
    (["--dp", "4", "--pp", "1", "--ep", "4"], 0.0),
    (["--dp", "4", "--pp", "1", "--ep", "2"], 1.0),
    (["--dp", "2", "--pp", "2", "--ep", "2", "--schedule", "1f1b"], 1.0),
    (["--dp", "4", "--pp", "1", "--ep", "2", "--zero", "2"], 1.0),
]


@pytest.mark.parametrize(
    ("layout", "capacity"), LAYOUTS, ids=["ep2", "ep4", "ep2dp4", "ep2pp2", "ep2zero2"]
)
def test_moe_gpt_expert_parallel_trains_like_one_process(
    tmp_path: Path, layout: list[str], capacity: float
) -> None:
    run_dir = tmp_path / "run"
    args = ["train", *_args(capacity), *layout, "--run-dir", str(run_dir)]
    assert main(args) == 0
    _check_run(run_dir, tmp_path, int(layout[layout.index("--dp") + 1]), capacity)


def test_capacity_one_drops_tokens() -> None:
    """The test can tell: at capacity factor 1 some token copies are dropped (the losses
    differ from dropless routing's), and routing per rank differs from the whole batch's."""
    dropping, _ = _reference(2 * M, 1.0)
    dropless, _ = _reference(2 * M, 0.0)
    assert abs(dropping[0] - dropless[0]) > 1e-4
    whole, _ = _reference(1, 1.0)
    assert abs(dropping[0] - whole[0]) > 1e-4


RESUMES = [
    (["--ep", "2"], []),  # whole expert tensors saved from ep slices, read without ep
    ([], ["--ep", "2", "--zero", "3"]),  # read into ep slices sharded over their replicas
]


@pytest.mark.parametrize(("saved", "resumed"), RESUMES, ids=["ep2-to-ep1", "ep1-to-ep2zero3"])
def test_ep_checkpoint_resumes_under_another_layout(
    tmp_path: Path, saved: list[str], resumed: list[str]
) -> None:
    """Expert tensors are saved whole: a checkpoint of step 1 saved under one ep resumes
    under another (dp=2 both times, so the routing is the same) and its second step
    matches one process."""
    first = tmp_path / "first"
    base = [*_args(1.0), "--dp", "2", "--pp", "1"]
    assert main(["train", *base, *saved, "--run-dir", str(first)]) == 0
    again = tmp_path / "again"
    resume = str(first / "checkpoints" / "step-00000001")
    assert main(["train", *base, *resumed, "--run-dir", str(again), "--resume", resume]) == 0
    _, grads = _reference(2 * M, 1.0)
    before, after = exported_weights(first, 1, tmp_path), exported_weights(again, 2, tmp_path)
    for name, g in grads[1].items():
        torch.testing.assert_close((before[name] - after[name]) / LR, g, **TOL, msg=name)


def _engine_world(rank: int, world: int, out: str, clip: float) -> None:
    """One clipped training step, an evaluation and the gathered model under dp=2, pp=2,
    ep=2 (1F1B), written to `out` by rank 0."""
    from plait.config import ParallelPlan
    from plait.data import SyntheticTokens
    from plait.models import MoEGPT
    from plait.train.parallelize import parallelize
    from plait.train.task import Task, gathered_model

    plan = ParallelPlan(dp=2, pp=2, ep=2, microbatches=M, schedule="1f1b")
    engine = parallelize(_model(1.0), plan, lambda ps: torch.optim.SGD(ps, lr=LR), MoEGPT.loss,
                         device="cpu", grad_clip=clip)  # fmt: skip
    data = SyntheticTokens(vocab=64, seq_len=32, size=4096, seed=0)
    report = engine.step(data.batch(0, BATCH))
    evaluated = engine.evaluate(data.batch(1, BATCH))
    task = Task(build=lambda: _model(1.0), batch=data.batch, loss=MoEGPT.loss)
    full = gathered_model(engine, task, None, rank)
    if full is not None:
        state = {k: v.clone() for k, v in full.state_dict().items()}
        torch.save({"loss": report.loss, "norm": report.grad_norm, "eval": evaluated.loss,
                    "samples": evaluated.samples, "state": state}, out)  # fmt: skip


def _mean_loss(
    model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, pieces: int
) -> Any:
    """One process's loss of the batch cut into `pieces` micro-batches: each one's token
    cross-entropy plus its router's auxiliary loss, averaged."""
    return (
        sum(
            F.cross_entropy(logits.reshape(-1, 64), y.flatten()) + carried[0]
            for x, y in zip(ids.chunk(pieces), targets.chunk(pieces), strict=True)
            for logits, carried in [model(x)]
        )
        / pieces
    )


def test_engine_clips_evaluates_and_gathers_under_ep(tmp_path: Path) -> None:
    """The global gradient norm counts every expert once (clipped to a third of it), the
    evaluation runs every forward on every ep rank, and rank 0's gathered model holds
    every expert whole: all as one process computes them."""
    from tests.dist.harness import run_world

    from plait.data import SyntheticTokens

    data = SyntheticTokens(vocab=64, seq_len=32, size=4096, seed=0)
    model = _model(1.0)
    ids, targets = data.batch(0, BATCH)
    pieces = 2 * M
    loss = _mean_loss(model, ids, targets, pieces)
    loss.backward()  # type: ignore[union-attr]
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))  # type: ignore[misc]
    clip = norm / 3
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad  # type: ignore[operator]
        ids, targets = data.batch(1, BATCH)
        evaluated = _mean_loss(model, ids, targets, pieces)

    out = tmp_path / "engine.pt"
    run_world(tmp_path, 4, _engine_world, str(out), clip)
    found = torch.load(out)
    torch.testing.assert_close(found["loss"], float(loss.detach()), **TOL)  # type: ignore[union-attr]
    torch.testing.assert_close(found["norm"], norm, **TOL)
    torch.testing.assert_close(found["eval"], float(evaluated), **TOL)  # type: ignore[arg-type]
    assert found["samples"] == BATCH
    reference = model.state_dict()
    assert set(found["state"]) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(found["state"][name], value, **TOL, msg=name)
