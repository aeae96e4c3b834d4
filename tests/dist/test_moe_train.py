"""`plait train --model moe-gpt` over pipeline and data parallelism against one process:
the router losses of a layer on the first stage reach the loss on the last stage, and
their gradient comes back across the boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.checkpoint.inspect import export_model
from plait.cli.main import main

pytestmark = pytest.mark.dist

STEPS, BATCH, LR, AUX, Z = 2, 16, 0.5, 0.5, 0.05
# every layer a MoE layer, so that the first stage's router losses must cross to the head;
# plain SGD without clipping or decay, so that each update is -LR × the gradient
ARGS = ["--model", "moe-gpt", "--data", "synthetic", "--layers", "2", "--hidden", "64",
        "--seq-len", "32", "--batch-size", str(BATCH), "--moe-every", "1",
        "--capacity-factor", "1.0", "--aux-loss-coef", str(AUX), "--z-loss-coef", str(Z),
        "--optimizer", "sgd", "--lr", str(LR), "--weight-decay", "0", "--grad-clip", "0",
        "--max-steps", str(STEPS), "--checkpoint-every", "1"]  # fmt: skip


def _moe_model(aux: float, z: float) -> torch.nn.Module:
    from plait.models import MoEConfig, MoEGPT

    torch.manual_seed(0)  # the run's seed
    cfg = MoEConfig(vocab_size=64, seq_len=32, num_layers=2, hidden=64, num_heads=4,
                    num_experts=4, top_k=2, capacity_factor=1.0, moe_every=1,
                    aux_loss_coef=aux, z_loss_coef=z)  # fmt: skip
    return MoEGPT(cfg)


def _reference(pieces: int, aux: float = AUX, z: float = Z) -> tuple[list[float], list[dict]]:  # type: ignore[type-arg]
    """Losses and gradients of each step in one process: the mean over `pieces` equal
    consecutive parts of the batch (dp × micro-batches) of cross-entropy + router losses."""
    return sgd_reference(_moe_model(aux, z), pieces)


def sgd_reference(model: torch.nn.Module, pieces: int) -> tuple[list[float], list[dict]]:  # type: ignore[type-arg]
    """`model` trained in one process by SGD on the runs' batches, each the mean over its
    `pieces` consecutive parts, each routed on its own, of cross-entropy + router losses:
    the losses and the gradients of every step."""
    from plait.data import SyntheticTokens

    data = SyntheticTokens(vocab=64, seq_len=32, size=4096, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        ids, targets = data.batch(step, BATCH)
        opt.zero_grad()
        loss = torch.zeros(())
        for x, y in zip(ids.chunk(pieces), targets.chunk(pieces), strict=True):
            logits, carried = model(x)
            loss = loss + F.cross_entropy(logits.reshape(-1, 64), y.flatten()) + carried[0]
        loss = loss / pieces
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
        losses.append(loss.item())
    return losses, grads


def exported_weights(run_dir: Path, step: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = export_model(run_dir / "checkpoints" / f"step-{step:08d}", tmp_path / f"w{step}.pt")
    state: dict[str, torch.Tensor] = torch.load(out)
    return state


LAYOUTS = [["--pp", "2", "--microbatches", "2"], ["--dp", "2", "--pp", "1", "--microbatches", "2"]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_gpt_trains_like_one_process(tmp_path: Path, layout: list[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *ARGS, *layout, "--run-dir", str(run_dir)]) == 0
    dp = int(layout[layout.index("--dp") + 1]) if "--dp" in layout else 1
    losses, grads = _reference(pieces=dp * 2)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(losses), **tol)

    before = _moe_model(AUX, Z).state_dict()
    for step in range(STEPS):  # each update is -LR × that step's gradient
        after = exported_weights(run_dir, step + 1, tmp_path)
        assert set(after) == set(grads[step])
        for name, g in grads[step].items():
            torch.testing.assert_close((before[name] - after[name]) / LR, g, **tol, msg=name)
        before = after

    # the test can tell: without the router losses the first layer's router gets another
    # gradient (its routing loss lives on the first stage, its loss on the last)
    _, plain = _reference(pieces=dp * 2, aux=0.0, z=0.0)
    router = "layers.1.ffn.router.gate.weight"
    assert (plain[0][router] - grads[0][router]).abs().max() > 1e-3
