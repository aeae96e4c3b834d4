"""The optimizer and learning-rate schedule a `TrainConfig` describes, built per pipeline stage.

Weight decay follows GPT-2/nanoGPT practice (Loshchilov & Hutter, "Decoupled Weight Decay
Regularization", 2019, for AdamW): it applies to matrices (linear and embedding weights)
and not to parameters of one dimension or none, i.e. biases and the weights of LayerNorm,
RMSNorm and BatchNorm. The rule is by shape, so it holds for tensor- or FSDP-sharded
parameters (DTensors keep their global shape) without knowing the module a parameter is in.

The schedule is a `LambdaLR` whose factor is a closed-form function of the number of
updates done, so a checkpoint's `last_epoch` resumes it exactly: a linear warm-up over
`warmup_steps` steps (update k < w of it at lr·(k+1)/(w+1), as torch's
`LinearLR(start_factor=1/(w+1))`), then constant, cosine (Loshchilov & Hutter, "SGDR",
2017, without restarts) or linear decay to `min_lr` at the last step, and `min_lr` after.
Steps count windows; an asynchronous schedule that updates u times per window takes u
schedule steps per window, so its warm-up and decay span the same windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from plait.config import TrainConfig

__all__ = ["lr_factor", "optimizer_factory", "param_groups", "scheduler_factory"]


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, object]]:
    """Two groups: matrices with `weight_decay`, biases and norm weights (ndim < 2) without."""
    decayed: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for p in params:
        (decayed if p.ndim >= 2 else plain).append(p)
    groups: list[dict[str, object]] = []
    if decayed:
        groups.append({"params": decayed, "weight_decay": weight_decay})
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    return groups


def optimizer_factory(
    cfg: TrainConfig,
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """`params -> optimizer` for `plait.parallelize`, one stage's parameters at a time."""

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        groups = param_groups(params, cfg.weight_decay)
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)

    return build


def lr_factor(cfg: TrainConfig, updates_per_step: int = 1) -> Callable[[int], float]:
    """The multiplier of `cfg.lr` after `k` updates (k = 0 before the first)."""
    warmup = cfg.warmup_steps * updates_per_step
    decay = max(1, (cfg.max_steps - cfg.warmup_steps) * updates_per_step)
    floor = cfg.min_lr / cfg.lr

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / (warmup + 1)
        t = min(k - warmup, decay) / decay
        if cfg.lr_schedule == "cosine":
            return floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2
        if cfg.lr_schedule == "linear":
            return 1 + (floor - 1) * t
        return 1.0

    return factor


def scheduler_factory(cfg: TrainConfig) -> Callable[[torch.optim.Optimizer, int], LRScheduler]:
    """`(optimizer, updates per step) -> schedule` for `plait.parallelize`."""

    def build(optimizer: torch.optim.Optimizer, updates_per_step: int) -> LRScheduler:
        return LambdaLR(optimizer, lr_factor(cfg, updates_per_step))

    return build
