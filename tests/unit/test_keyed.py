"""Keyed dropout: the hash against a pure-Python one written here, masks of any block of a
tensor equal to that block of the whole tensor's mask, and a GPT's forward the same however
its batch is cut into micro-batches."""

from __future__ import annotations

import torch

from plait.keyed import Draw, KeyedDropout, drawing, hash32, keep_mask
from plait.models import GPT, GPTConfig

M32 = 0xFFFFFFFF


def _mix(v: int) -> int:  # the 32-bit mixer, in plain Python integers
    v &= M32
    v ^= v >> 16
    v = (v * 0x7FEB352D) & M32
    v ^= v >> 15
    v = (v * 0x1B873593) & M32
    return v ^ (v >> 16)


def _hash(key: int, counter: int) -> int:
    k = _mix(key & ((1 << 62) - 1))
    return _mix((counter & M32) ^ _mix((counter >> 32) ^ (k * 0x2C1B3C6D)) ^ k)


def test_hash_equals_the_written_out_one() -> None:
    counters = [0, 1, 2, 12345, 2**32 - 1, 2**32, 2**40 + 17, 2**62 - 5]
    for key in (0, 1, 987654321987, 2**61 + 3):
        got = hash32(key, torch.tensor(counters, dtype=torch.int64)).tolist()
        assert got == [_hash(key, c) for c in counters]


def test_a_block_of_the_mask_is_the_mask_of_the_block() -> None:
    draw, shape = Draw(seed=3, step=5, index=0), (6, 4, 5, 5)
    whole = keep_mask(draw, 11, 0.3, shape, (0, 0, 0, 0), shape, torch.device("cpu"))
    # heads 2..3 of samples 3..5 (a tensor-parallel rank's heads of a dp rank's rows)
    part = keep_mask(draw, 11, 0.3, shape, (3, 2, 0, 0), (3, 2, 5, 5), torch.device("cpu"))
    assert torch.equal(part, whole[3:6, 2:4])
    # micro-batch 1 of rows 3: the rows 3..5 of the step's batch, as its own tensor
    second = keep_mask(Draw(3, 5, 1), 11, 0.3, (3, 4, 5, 5), (0,) * 4, (3, 4, 5, 5),
                       torch.device("cpu"))  # fmt: skip
    assert torch.equal(second, whole[3:6])
    other_site = keep_mask(draw, 12, 0.3, shape, (0,) * 4, shape, torch.device("cpu"))
    other_step = keep_mask(Draw(3, 6, 0), 11, 0.3, shape, (0,) * 4, shape, torch.device("cpu"))
    assert not torch.equal(other_site, whole) and not torch.equal(other_step, whole)


def test_keep_rate_and_scaling() -> None:
    x = torch.ones(64, 1000)
    drop = KeyedDropout(0.25)
    with drawing(1, 0, 0):
        y = drop(x)
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.75) < 0.01
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    assert torch.equal(drop.eval()(x), x)


def test_gpt_forward_does_not_depend_on_the_micro_batch_cut() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=13, seq_len=8, num_layers=2, hidden=16, num_heads=4,
                          dropout=0.2))  # fmt: skip
    ids = torch.randint(0, 13, (8, 8))
    with drawing(5, 2, 0):
        whole = model(ids)
    parts = []
    for index in range(4):  # 4 micro-batches of 2 samples
        with drawing(5, 2, index):
            parts.append(model(ids[2 * index : 2 * index + 2]))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    with drawing(5, 3, 0):  # another step: other masks
        assert not torch.allclose(model(ids), whole)
