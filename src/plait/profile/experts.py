"""Timing one expert-parallel MoE layer on this rank: forward and backward seconds and the
token copies its local experts receive (`plait.parallel.experts` shards it)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.device import current as current_device
from plait.device import synchronize
from plait.models.moe import MoEConfig, MoELayer
from plait.parallel.experts import shard_experts

__all__ = ["ExpertBench", "bench_expert_parallel"]


@dataclass(frozen=True)
class ExpertBench:
    """Median seconds of one expert-parallel layer's forward and backward on this rank,
    with the token copies it received for its local experts per step (mean)."""

    ep: int
    tokens: int
    forward_s: float
    backward_s: float
    received_copies: float


def bench_expert_parallel(
    ep_group: dist.ProcessGroup,
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    num_experts: int,
    top_k: int = 2,
    capacity_factor: float | None = 1.25,
    steps: int = 10,
    warmup: int = 2,
    device: torch.device | None = None,
) -> ExpertBench:
    """Time forward and backward of one MoE layer sharded over `ep_group`, on `tokens`
    random tokens per rank. Call it on every rank of the group at once."""
    if tokens < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"tokens={tokens}, steps={steps} must be >= 1, warmup={warmup} >= 0")
    device = device or current_device()
    cfg = MoEConfig(hidden=hidden, num_heads=1, ffn_hidden=ffn, num_experts=num_experts,
                    top_k=top_k, capacity_factor=capacity_factor)  # fmt: skip
    torch.manual_seed(0)  # the same layer on every rank, as a model is built
    layer = MoELayer(cfg).to(device)
    shard_experts(layer, ep_group)
    received: list[int] = []
    layer.experts.register_forward_hook(lambda _m, args, _o: received.append(args[0].shape[0]))
    torch.manual_seed(1 + dist.get_rank())  # but each rank its own tokens
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    fwd, bwd = [], []
    for step in range(warmup + steps):
        t0 = _now(device)
        y, aux = layer(x)
        t1 = _now(device)
        (y.square().mean() + aux).backward()
        t2 = _now(device)
        if step >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return ExpertBench(
        ep=dist.get_world_size(ep_group),
        tokens=tokens,
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(bwd),
        received_copies=statistics.fmean(received[warmup:]),
    )


def _now(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()
