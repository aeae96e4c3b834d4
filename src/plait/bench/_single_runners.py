"""The five ways `plait bench single` trains one GPT: plait's engine, eager or compiled, and
the plain loop with torch's default AdamW, fused AdamW, or fused AdamW and torch.compile."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Context", "Runner", "build"]


@dataclass(frozen=True)
class Context:
    """What every variant of one bench shares: its config, device and one-rank mesh (made
    once: plait's engines are built again for each block), and the model's size."""

    config: Any  # plait.bench.single.SingleBenchConfig
    device: torch.device
    mesh: DeviceMesh
    num_params: int
    flops_per_step: float

    @classmethod
    def build(cls, config: Any, device: torch.device) -> Context:
        from plait.cost.transformer import transformer_block_costs
        from plait.layout import Layout
        from plait.mesh import build_mesh
        from plait.models import GPT

        mesh = build_mesh(Layout(), device.type).main
        with torch.device("meta"):
            num_params = sum(p.numel() for p in GPT(config.gpt_config()).parameters())
        blocks = transformer_block_costs(
            num_layers=config.num_layers, hidden=config.hidden, num_heads=config.num_heads,
            seq_len=config.seq_len, vocab_size=config.vocab_size,
            micro_batch_size=config.batch_size, dtype=config.dtype, device_type=device.type,
        )  # fmt: skip
        flops = sum(b.forward_flops + b.backward_input_flops + b.backward_weight_flops
                    for b in blocks)  # fmt: skip
        return cls(config, device, mesh, num_params, float(flops))


class Runner(Protocol):
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step on (token ids, targets); its loss."""
        ...


def build(variant: str, context: Context) -> Runner:
    """A fresh `variant` (see `plait.bench.single`) from the bench's seed."""
    if variant.startswith("plait"):
        return _Plait(context, compile=variant == "plait_compiled")
    return _Plain(context, fused=variant != "plain", compile=variant == "plain_compiled")


def _model(context: Context) -> torch.nn.Module:
    from plait.models import GPT

    torch.manual_seed(context.config.seed)
    with torch.device(context.device):
        return GPT(context.config.gpt_config())


def _adamw(context: Context, fused: bool | None) -> Callable[[Any], torch.optim.Optimizer]:
    lr = context.config.lr
    return lambda params: torch.optim.AdamW(params, lr=lr, fused=fused)


class _Plait:
    def __init__(self, context: Context, *, compile: bool) -> None:
        from plait.config import ParallelPlan
        from plait.device import fused_optimizers
        from plait.models import GPT
        from plait.train.parallelize import parallelize

        config = context.config
        plan = ParallelPlan(dp=1, tp=1, pp=1, microbatches=1, dtype=config.dtype)
        fused = True if fused_optimizers(context.device) else None  # optimizer_impl=auto
        self.engine = parallelize(
            _model(context), plan, _adamw(context, fused), GPT.loss, mesh=context.mesh,
            device=context.device, grad_clip=config.grad_clip, compile=compile,
        )  # fmt: skip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.engine.step((x, y)).loss


class _Plain:
    """The loop a practitioner writes (autocast and, for fp16, a GradScaler)."""

    def __init__(self, context: Context, *, fused: bool, compile: bool) -> None:
        from plait.device import autocast_context

        config = context.config
        self.model = _model(context)
        if compile:
            self.model.compile()
        self.optimizer = _adamw(context, True if fused else None)(self.model.parameters())
        self.autocast = autocast_context(config.dtype, context.device)
        self.scaler = torch.amp.GradScaler(context.device.type) if config.dtype == "fp16" else None
        self.clip = config.grad_clip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with self.autocast():
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        if self.scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
