"""`grouped_ffn` against each expert's FFN computed alone here, gradients included: fp32
to 1e-5, an expert without rows gets zero gradients, and under a bf16 autocast the result
keeps the input's dtype and equals the loop computed from bf16-cast operands."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.models.grouped_ffn import grouped_ffn

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _weights(e: int, h: int, f: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(e, h, f), (e, f), (e, f, h), (e, h)]
    return [(torch.randn(*s) * 0.3).requires_grad_() for s in shapes]


def _loop(x: torch.Tensor, ws: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    rows, start = [], 0
    for i, c in enumerate(counts):
        xi = x[start : start + c]
        rows.append(F.gelu(xi @ ws[0][i] + ws[1][i]) @ ws[2][i] + ws[3][i])
        start += c
    return torch.cat(rows)


def test_fp32_values_and_gradients_equal_the_loop() -> None:
    counts = [3, 0, 5, 2]
    ws = _weights(4, 6, 10)
    x = torch.randn(sum(counts), 6, requires_grad=True)
    probe = torch.randn(sum(counts), 6)
    got = grouped_ffn(x, *ws, counts)
    grads = torch.autograd.grad((got * probe).sum(), [x, *ws])
    want = _loop(x, ws, counts)
    want_grads = torch.autograd.grad((want * probe).sum(), [x, *ws])
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    for g in grads[1:]:  # expert 1 received nothing
        assert torch.count_nonzero(g[1]) == 0


def test_bf16_autocast_computes_in_bf16_and_returns_the_input_dtype() -> None:
    counts = [4, 4]
    ws = _weights(2, 8, 16)
    x = torch.randn(8, 8)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        got = grouped_ffn(x, *ws, counts)
    assert got.dtype == torch.float32
    low = [w.detach().bfloat16() for w in ws]
    want = _loop(x.bfloat16(), low, counts).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
