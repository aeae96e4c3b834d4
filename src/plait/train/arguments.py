"""The Python API's argument checks: what `plait.parallelize` refuses before it touches a
process group, with a `TypeError` that names the argument, what it got and what it needs."""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.blocks import as_blocks
from plait.config import ParallelPlan

__all__ = ["check_parallelize_arguments"]

_MODEL_KINDS = (
    "an nn.Module whose layers can be cut into stages: an nn.Sequential, a module with a "
    "`blocks()` method returning its layers in order (e.g. a plait.blocks.BlockChain), or a "
    "reference model from plait.models"
)


def _got(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check_parallelize_arguments(
    model: Any, plan: Any, optimizer_factory: Any, loss_fn: Any
) -> None:
    """Refuse arguments of the wrong kind at once (an int as the model used to fail deep
    inside with `AttributeError: 'int' object has no attribute 'modules'`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be {_MODEL_KINDS}; got {_got(model)}")
    try:
        as_blocks(model)
    except TypeError as err:
        raise TypeError(f"parallelize: {err}") from None
    if not isinstance(plan, ParallelPlan):
        raise TypeError(
            f"parallelize: plan must be a plait.ParallelPlan (e.g. ParallelPlan(pp=2, "
            f"microbatches=4)); got {_got(plan)}"
        )
    if not callable(optimizer_factory):
        raise TypeError(
            "parallelize: optimizer_factory must be a callable taking parameters and returning "
            "an optimizer (e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)); got "
            f"{_got(optimizer_factory)}"
        )
    if not callable(loss_fn):
        raise TypeError(
            "parallelize: loss_fn must be a callable (output, target) -> scalar tensor (e.g. "
            f"torch.nn.functional.cross_entropy); got {_got(loss_fn)}"
        )
