"""Expert parallelism composed with tensor parallelism, ZeRO-1 and gradient compression
against one process, in one world of four gloo ranks running every layout in turn.

Under tp > 1 the tp ranks of a replica split a MoE layer's tokens, so routing, capacity
and the router losses must still be those of the replica's whole micro-batch: one process
that runs the model on each replica's micro-batch separately and averages the losses
computes them. Token dropping is active (capacity factor 1.0, `test_moe_ep_train.py`'s
`test_capacity_one_drops_tokens`) and the router losses are weighted heavily, so their
gradients are in the compared ones. Each case trains `STEPS` SGD steps; the whole model
gathered after every step gives that step's update (-LR × its gradient).

Under fp16/bf16 compression the non-expert gradients are compressed, so they match within
the format's precision; the expert gradients are reduced uncompressed over their replicas,
so the first step's (before any compressed update) match as closely as without
compression (`none` equivalence, 1e-5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .test_moe_train import BATCH, LR, STEPS, sgd_reference

pytestmark = pytest.mark.dist

AUX, Z, M = 0.5, 0.05, 2  # STEPS, BATCH and LR are test_moe_train.py's
TOL = {"rtol": 1e-5, "atol": 1e-5}

# (name, ParallelPlan fields, (shared expert, every k-th layer a MoE layer)) on 4 ranks;
# ep borrows dp × tp ranks
CASES: list[tuple[str, dict[str, Any], tuple[bool, int]]] = [
    ("tp2dp2ep2", {"dp": 2, "tp": 2, "ep": 2}, (False, 1)),
    ("tp2dp2ep4", {"dp": 2, "tp": 2, "ep": 4}, (True, 1)),
    ("tp2pp2ep2", {"dp": 1, "tp": 2, "pp": 2, "ep": 2, "schedule": "1f1b"}, (False, 1)),
    ("tp2dp2ep1", {"dp": 2, "tp": 2, "ep": 1}, (True, 2)),  # a dense layer, then a MoE one
    # ZeRO-1: experts partitioned over their 2 replicas, the rest over the 4 dp ranks
    ("dp4ep2zero1", {"dp": 4, "ep": 2, "zero": 1}, (False, 1)),
    # compression of the dp reduction; expert gradients are reduced uncompressed
    ("dp4ep2fp16", {"dp": 4, "ep": 2, "compress": "fp16"}, (False, 1)),
    ("dp4ep4bf16", {"dp": 4, "ep": 4, "compress": "bf16"}, (True, 1)),
]
# compressed: a gradient's error relative to its norm, a few unit roundoffs of the format
# (2^-11 for fp16, 2^-8 for bf16) summed over the dp ranks
COMPRESSED = {"fp16": 2.0**-9, "bf16": 2.0**-6}


def _model(options: tuple[bool, int] = (False, 1)) -> torch.nn.Module:
    from plait.models import MoEConfig, MoEGPT

    torch.manual_seed(0)
    cfg = MoEConfig(vocab_size=64, seq_len=32, num_layers=2, hidden=64, num_heads=4,
                    num_experts=4, top_k=2, capacity_factor=1.0,
                    shared_expert=options[0], moe_every=options[1], aux_loss_coef=AUX,
                    z_loss_coef=Z)  # fmt: skip
    return MoEGPT(cfg)


def _world(rank: int, world: int, out: str) -> None:
    """Every case: the loss and the gathered model's state after each step (rank 0)."""
    from plait.config import ParallelPlan
    from plait.data import SyntheticTokens
    from plait.models import MoEGPT
    from plait.train.parallelize import parallelize
    from plait.train.task import Task, gathered_model

    data = SyntheticTokens(vocab=64, seq_len=32, size=4096, seed=0)
    found: dict[str, Any] = {}
    for name, fields, options in CASES:
        plan = ParallelPlan(microbatches=M, **{"pp": 1, **fields})
        engine = parallelize(_model(options), plan, lambda ps: torch.optim.SGD(ps, lr=LR),
                             MoEGPT.loss, device="cpu")  # fmt: skip
        task = Task(build=lambda o=options: _model(o), batch=data.batch, loss=MoEGPT.loss)
        losses, states = [], []
        for step in range(STEPS):
            losses.append(engine.step(data.batch(step, BATCH)).loss)
            full = gathered_model(engine, task, None, rank)
            if full is not None:
                states.append({k: v.clone() for k, v in full.state_dict().items()})
        found[name] = {"losses": losses, "states": states}
    if rank == 0:
        torch.save(found, out)


def test_expert_parallel_composes_like_one_process(tmp_path: Path) -> None:
    from tests.dist.harness import run_world

    out = tmp_path / "found.pt"
    run_world(tmp_path, 4, _world, str(out))
    found = torch.load(out)
    experts = {n for n, _ in _model().named_parameters() if ".experts." in n}
    for name, fields, options in CASES:
        losses, grads = sgd_reference(_model(options), fields["dp"] * M)
        got = found[name]
        bound = COMPRESSED.get(fields.get("compress", "none"))
        torch.testing.assert_close(got["losses"][0], losses[0], **TOL, msg=name)
        if bound is None:
            torch.testing.assert_close(got["losses"], losses, **TOL, msg=name)
        before = _model(options).state_dict()
        for step, after in enumerate(got["states"]):
            assert set(after) == set(grads[step]), name
            for key, g in grads[step].items():
                diff, where = (before[key] - after[key]) / LR, f"{name} step {step} {key}"
                if bound is None or (step == 0 and key in experts):
                    torch.testing.assert_close(diff, g, **TOL, msg=where)
                else:
                    # plus the exact cases' 1e-5 per entry (reading an update off fp32 weights)
                    slack = TOL["atol"] * g.numel() ** 0.5
                    assert float((diff - g).norm()) <= bound * float(g.norm()) + slack, where
            before = after
