"""Ring attention on an emulated ring equals whole-sequence causal SDPA (forward, grads),
and with attention dropout the whole-sequence attention dropped by the same mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.parallel.context import (
    attention_backward_steps,
    attention_forward_steps,
    run_emulated,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)


def _reference(q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring(q, k, v, dout, cp, keep=None):
    """Shard on dim 2 (the sequence of [b, h, s, d]), run every rank, gather back. `keep`
    [b, h, s, s]: dropout multipliers, whose rows each rank takes for its queries."""
    shards = [[zigzag_shard(t, cp, r, dim=2) for t in (q, k, v, dout)] for r in range(cp)]
    rows = [None if keep is None else zigzag_shard(keep, cp, r, dim=2) for r in range(cp)]
    scale = q.shape[-1] ** -0.5
    forward = run_emulated([
        attention_forward_steps(sq, sk, sv, rank=r, cp=cp, scale=scale, keep=rows[r])
        for r, (sq, sk, sv, _) in enumerate(shards)
    ])  # fmt: skip
    backward = run_emulated([
        attention_backward_steps(sq, sk, sv, out, lse, sd, rank=r, cp=cp, scale=scale,
                                 keep=rows[r])
        for r, ((sq, sk, sv, sd), (out, lse)) in enumerate(zip(shards, forward, strict=True))
    ])  # fmt: skip
    out = zigzag_unshard([o for o, _ in forward], dim=2)
    grads = [zigzag_unshard([g[i] for g in backward], dim=2) for i in range(3)]
    return out, *grads


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", [1, 3, 4])
def test_ring_equals_causal_sdpa(cp: int, heads: int) -> None:
    g = torch.Generator().manual_seed(cp * 10 + heads)
    seq = 2 * cp * 3  # odd chunks of 3 tokens
    q, k, v, dout = (torch.randn(2, heads, seq, 8, generator=g) for _ in range(4))
    want = _reference(q, k, v, dout)
    got = _ring(q, k, v, dout, cp)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def _dropped_reference(q, k, v, dout, keep):
    """Whole-sequence causal attention with its probabilities times `keep`, by autograd."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    out = (scores.masked_fill(~causal, float("-inf")).softmax(-1) * keep) @ v
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_with_attention_dropout_equals_the_whole_dropped_attention(cp: int) -> None:
    g = torch.Generator().manual_seed(cp)
    p, seq = 0.1, 2 * cp * 3
    q, k, v, dout = (torch.randn(2, 3, seq, 8, generator=g) for _ in range(4))
    keep = (torch.rand(2, 3, seq, seq, generator=g) >= p).float() / (1 - p)
    want = _dropped_reference(q, k, v, dout, keep)
    got = _ring(q, k, v, dout, cp, keep)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    # the mask matters: the undropped ring differs
    assert not torch.allclose(_ring(q, k, v, dout, cp)[0], want[0], atol=1e-3)


def test_zigzag_positions_head_and_tail() -> None:
    # 16 tokens over cp=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(24).view(1, 24)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, 3, r) for r in range(3)]), x)


def test_bad_splits_are_refused() -> None:
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 2·cp = 4"):
        zigzag_positions(10, 2, 0)
    q = torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="odd number"):
        run_emulated([attention_forward_steps(q, q, q, rank=r, cp=2, scale=0.5)
                      for r in range(2)])  # fmt: skip
