"""One micro-batch's backward through one stage: full, or split into input and weight parts.

The split (zero-bubble BI/BW) uses torch.distributed.pipelining's `stage_backward_input`
and `stage_backward_weight`, which save the gradients at the points where the weight
paths join the input paths so that BW computes only the weight gradients. Two cases fall
outside what that split captures, and take the full backward in BW instead (BI then only
produces input gradients, keeping the graph): a stage whose inputs need no gradient (the
first stage); a stage with a weight whose gradient path never meets an input's (torch's
split would drop that weight's gradient); and a stage sharded by FSDP, whose autograd
graph holds the gathered copies of the weights rather than the parameters themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.compat import (
    construct_reverse_graph,
    get_grad_fn_or_grad_acc,
    get_param_groups,
    stage_backward_input,
    stage_backward_weight,
)

__all__ = ["Saved", "backward_full", "backward_input", "backward_weight", "split_is_exact"]


@dataclass
class Saved:
    """What one forward keeps for its backward."""

    inputs: list[torch.Tensor]  # the stage's input leaves (floating ones require grad)
    outputs: list[torch.Tensor]  # output leaves that require grad, or [loss] on the last stage
    param_groups: list[dict[str, Any]] | None = None
    output_grads: list[torch.Tensor] | None = None
    full_in_weight_pass: bool = False
    # which output leaves carry a gradient (the peer sends one for every floating leaf)
    output_requires: list[bool] = field(default_factory=list)
    module: nn.Module | None = None  # the stage module (or weight copy) the forward ran on


def _input_grads(saved: Saved) -> list[torch.Tensor | None]:
    return [t.grad if t.requires_grad else None for t in saved.inputs]


def backward_full(
    saved: Saved, output_grads: list[torch.Tensor] | None
) -> list[torch.Tensor | None]:
    """Input and weight gradients together; returns the gradients of the input leaves."""
    if saved.outputs:
        torch.autograd.backward(saved.outputs, grad_tensors=output_grads)
    return _input_grads(saved)


def split_is_exact(saved: Saved, module: nn.Module) -> bool:
    """Whether torch's BI/BW split gives every weight on the graph its gradient.

    The answer depends on the stage's structure only, so callers compute it once per stage.
    """
    if not any(t.requires_grad for t in saved.inputs) or not saved.outputs:
        return False
    roots = [fn for fn in map(get_grad_fn_or_grad_acc, saved.outputs) if fn is not None]
    reverse = construct_reverse_graph(roots)
    on_graph = set(reverse) | {n for nodes in reverse.values() for n in nodes}
    inputs = [fn for fn in map(get_grad_fn_or_grad_acc, saved.inputs) if fn is not None]
    weights = [fn for fn in map(get_grad_fn_or_grad_acc, module.parameters()) if fn is not None]
    covered: set[Any] = set()
    for group in get_param_groups(inputs, weights, reverse):
        covered |= group["params"]
    # a weight missing from the graph (FSDP computes with gathered copies, not with the
    # sharded parameters) or missing from every group would lose its gradient
    return all(w in on_graph and w in covered for w in weights)


def backward_input(
    saved: Saved, output_grads: list[torch.Tensor] | None, module: nn.Module, *, exact: bool
) -> list[torch.Tensor | None]:
    """BI: gradients of the stage inputs; weight gradients are left for `backward_weight`.

    With `exact` False (see `split_is_exact`) the graph is kept whole and BW runs the full
    backward for the weights.
    """
    if not saved.outputs:
        return _input_grads(saved)
    if not exact:
        saved.full_in_weight_pass, saved.output_grads = True, output_grads
        needing = [t for t in saved.inputs if t.requires_grad]
        if not needing:
            return _input_grads(saved)
        grads: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
            saved.outputs,
            needing,
            grad_outputs=output_grads,
            retain_graph=True,
            allow_unused=True,
        )
        it = iter(grads)
        return [next(it) if t.requires_grad else None for t in saved.inputs]
    grads, saved.param_groups = stage_backward_input(
        saved.outputs, output_grads, saved.inputs, module.parameters()
    )
    return list(grads)


def backward_weight(saved: Saved, module: nn.Module) -> None:
    """BW: the weight gradients of a micro-batch whose BI has run."""
    if saved.full_in_weight_pass:
        torch.autograd.backward(saved.outputs, grad_tensors=saved.output_grads)
    elif saved.param_groups is not None:
        stage_backward_weight(module.parameters(), saved.param_groups)
