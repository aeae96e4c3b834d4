"""The expert FFNs of a MoE layer on token copies grouped by expert, as one autograd node.

`grouped_ffn(x, w1, b1, w2, b2, counts)` computes, for each expert i and its `counts[i]`
consecutive rows of `x`, `gelu(x_i @ w1[i] + b1[i]) @ w2[i] + b2[i]`, the experts' weights
stacked ([E, hidden, ffn], [E, ffn], [E, ffn, hidden], [E, hidden]).

Why one `autograd.Function` rather than a loop of differentiable ops: on a CPU (and for
small experts on a GPU) the GEMMs are not all of the time. A loop of `x_i @ w1[i] + b1[i]`
adds per expert an autograd node per op, a bias add over the whole output and a
`torch.cat` of the outputs; its backward stacks the E weight-gradient slices again
(`unbind`'s backward) and sums the row gradients of each bias add separately. Here the
forward writes each expert's GEMM, its bias fused (`addmm`), into its rows of one
preallocated output, and one GELU runs over all rows at once; the backward writes the
expert's weight gradient straight into its slice of the stacked gradient. The GEMMs are
the same ones, in the same order, so the results are those of the loop (up to the fused
bias add's rounding). This is the loop that torch's `_grouped_mm` runs on devices without
a grouped-GEMM kernel (torchtitan calls it), without its bf16-only restriction on a CPU.

Under an autocast (plait's `--dtype bf16`), the input is cast to the autocast dtype once,
and each expert's weights just before its GEMM, inside the node: an expert's slice (a
fraction of a MiB) is converted while it fits in the cache and read from there by the
GEMM, where casting the stacked weights whole streams them through memory twice (on this
project's CPU the two whole casts and the two casts of their gradients took about a fifth
of the layer's step). The backward casts the slices again rather than keeping the
low-precision copies (no extra memory between forward and backward) and writes each
expert's weight gradient, computed in the autocast dtype, into its slice of the stacked
gradient in the weights' dtype. The output is cast back to the input's dtype, as a loop
under autocast returns it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["grouped_ffn"]


def grouped_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    counts: list[int],
) -> torch.Tensor:
    """The experts on `x` [sum(counts), hidden], rows grouped by expert; see the module."""
    if len(counts) != w1.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"counts={counts} must give one count per expert ({w1.shape[0]}) and add up to "
            f"the {x.shape[0]} rows"
        )
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device_type=device, enabled=False):
            out: torch.Tensor = _GroupedFFN.apply(x.to(dtype), w1, b1, w2, b2, counts, dtype)  # type: ignore[no-untyped-call]
        return out.to(x.dtype)
    return _GroupedFFN.apply(x, w1, b1, w2, b2, counts, x.dtype)  # type: ignore[no-untyped-call]


def _bounds(counts: list[int]) -> list[tuple[int, slice]]:
    """(expert, its rows) for every expert that received rows."""
    out, start = [], 0
    for i, c in enumerate(counts):
        if c:
            out.append((i, slice(start, start + c)))
        start += c
    return out


class _GroupedFFN(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        b1: torch.Tensor,
        w2: torch.Tensor,
        b2: torch.Tensor,
        counts: list[int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        rows = _bounds(counts)
        low1, low2 = b1.to(dtype), b2.to(dtype)
        pre = x.new_empty(x.shape[0], w1.shape[2])  # [copies, ffn], before the GELU
        for i, r in rows:
            torch.addmm(low1[i], x[r], w1[i].to(dtype), out=pre[r])
        act = F.gelu(pre)
        out = x.new_empty(x.shape[0], w2.shape[2])
        for i, r in rows:
            torch.addmm(low2[i], act[r], w2[i].to(dtype), out=out[r])
        ctx.save_for_backward(x, w1, w2, pre, act)
        ctx.rows, ctx.dtype = rows, dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2, pre, act = ctx.saved_tensors
        rows: list[tuple[int, slice]] = ctx.rows
        dtype: torch.dtype = ctx.dtype
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        grad = grad.contiguous()
        # every expert's slice is written below, or zeroed when it received no rows
        busy = {i for i, _ in rows}
        idle = [i for i in range(w1.shape[0]) if i not in busy]
        dw1 = _grad(w1, w1.shape, idle, need_w1)
        db1 = _grad(w1, (w1.shape[0], w1.shape[2]), idle, need_b1)
        dw2 = _grad(w2, w2.shape, idle, need_w2)
        db2 = _grad(w2, (w2.shape[0], w2.shape[2]), idle, need_b2)
        dact = grad.new_empty(act.shape)
        for i, r in rows:
            torch.mm(grad[r], w2[i].to(dtype).t(), out=dact[r])
            _into(dw2, i, act[r].t(), grad[r])
            if db2 is not None:
                db2[i] = grad[r].sum(dim=0)
        dpre = torch.ops.aten.gelu_backward(dact, pre)
        dx = x.new_empty(x.shape) if need_x else None
        for i, r in rows:
            if dx is not None:
                torch.mm(dpre[r], w1[i].to(dtype).t(), out=dx[r])
            _into(dw1, i, x[r].t(), dpre[r])
            if db1 is not None:
                db1[i] = dpre[r].sum(dim=0)
        return dx, dw1, db1, dw2, db2, None, None


def _into(grad: torch.Tensor | None, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """Expert i's slice of a stacked weight gradient = a @ b, computed in their dtype and
    stored in the gradient's (straight into the slice when the two agree)."""
    if grad is None:
        return
    if grad.dtype == a.dtype:
        torch.mm(a, b, out=grad[i])
    else:
        grad[i] = torch.mm(a, b)


def _grad(like: torch.Tensor, shape: Any, idle: list[int], needed: bool) -> torch.Tensor | None:
    """An uninitialised stacked gradient whose `idle` experts' slices are zero."""
    if not needed:
        return None
    grad = like.new_empty(shape)
    if idle:
        grad[idle] = 0
    return grad
