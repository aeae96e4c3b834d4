"""Weight prediction: the weights a stage will have `d` updates from now, estimated from
its optimizer's last update direction.

SpecTrain (Chen, Yang and Cheng 2018) predicts Ŵ = W - d·lr·v with v SGD's momentum (the
smoothed gradient); XPipe (Guan et al. 2019) and PipeOptim use Adam's step direction. Both
read u, the update direction with the learning rate factored out (W ← W - lr·u):

- SGD with momentum μ > 0 (dampening any, not Nesterov): u = the momentum buffer;
- Adam and AdamW (not AMSGrad): u = (m / (1 - β1^t)) / (√(v / (1 - β2^t)) + ε), the
  bias-corrected direction torch applies; AdamW's decoupled weight decay is left out.

Before a stage's first update there is no direction: u = 0 and Ŵ = W. Limits: the
prediction is linear in d (the direction is assumed constant over the d updates); the
optimizer must hold the whole parameter (no ZeRO sharding of its state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from plait.runtime.weights import Predictor

__all__ = ["check_predictable", "optimizer_predictor", "update_direction"]


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """Raise a ValueError naming the fix unless `optimizer` is one weight prediction reads."""
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD):
            if group["momentum"] <= 0 or group["nesterov"]:
                raise ValueError(
                    f"weight prediction reads SGD's momentum: use momentum > 0 without "
                    f"Nesterov (got momentum={group['momentum']}, nesterov={group['nesterov']})"
                )
        elif isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            if group.get("amsgrad"):
                raise ValueError("weight prediction follows Adam's update: turn amsgrad off")
        else:
            raise ValueError(
                f"weight prediction supports SGD with momentum, Adam and AdamW, not {name}: "
                "choose one of them, or a schedule without prediction (pipedream, 2bw)"
            )


def update_direction(
    optimizer: torch.optim.Optimizer, group: Mapping[str, object], param: torch.Tensor
) -> torch.Tensor | None:
    """u for `param` (in `group` of `optimizer`), or None before its first update."""
    state = optimizer.state.get(param, {})
    if isinstance(optimizer, torch.optim.SGD):
        return state.get("momentum_buffer")
    if "exp_avg" not in state:
        return None
    step = float(state["step"])
    betas: tuple[float, float] = group["betas"]  # type: ignore[assignment]
    beta1, beta2 = betas
    eps = float(group["eps"])  # type: ignore[arg-type]
    first = state["exp_avg"] / (1 - beta1**step)
    second = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)
    return first / (second + eps)


def optimizer_predictor(
    optimizers: Mapping[int, torch.optim.Optimizer],
) -> Predictor:
    """A `WeightStore` predictor over each stage's optimizer: fills the replica with
    W - d·lr·u, parameter by parameter."""
    for optimizer in optimizers.values():
        check_predictable(optimizer)

    @torch.no_grad()
    def predict(stage: int, live: nn.Module, out: nn.Module, distance: int) -> None:
        optimizer = optimizers[stage]
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for p, q in zip(live.parameters(), out.parameters(), strict=True):
            q.copy_(p)
            group = group_of.get(id(p))
            if group is None or distance == 0:
                continue
            u = update_direction(optimizer, group, p)
            if u is not None:
                q.add_(u, alpha=-distance * float(group["lr"]))

    return predict
