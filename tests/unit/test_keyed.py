"""Keyed dropout: a sample's mask as its seed's `torch.rand` (written out here), masks of
any block of a tensor equal to that block of the whole tensor's mask (a context-parallel
shard's included), and a GPT's forward the same however its batch is cut into
micro-batches."""

from __future__ import annotations

import torch

from plait.keyed import Draw, KeyedDropout, drawing, keep_mask
from plait.models import GPT, GPTConfig
from plait.models.gpt import Attention
from plait.parallel.context import zigzag_positions, zigzag_shard, zigzag_unshard


def test_a_sample_mask_is_torch_rand_from_its_own_seeded_generator() -> None:
    import hashlib

    draw, shape = Draw(seed=3, step=5, index=2), (4, 3, 5)
    mask = keep_mask(draw, 7, 0.4, shape, (0, 0, 0), shape, torch.device("cpu"))
    for r in range(4):  # sample 2 * 4 + r of the step, written out
        text = f"3:5:7:{2 * 4 + r}".encode()
        seed = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
        expected = torch.rand((3, 5), generator=torch.Generator().manual_seed(seed)) >= 0.4
        assert torch.equal(mask[r], expected)


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


def _cp_shard(cp: int, rank: int):  # the shard the context-parallel pass gives each module
    return lambda n: (zigzag_positions(n * cp, cp, rank), n * cp)


def test_a_context_parallel_shard_drops_what_the_whole_sequence_drops() -> None:
    x = torch.randn(3, 16, 4)  # [batch, seq, hidden]
    drop = KeyedDropout(0.3)
    drop.site = 5
    with drawing(2, 1, 0):
        whole = drop(x)
        for cp in (2, 4):
            parts = []
            for rank in range(cp):
                drop.cp_shard = _cp_shard(cp, rank)
                parts.append(drop(zigzag_shard(x, cp, rank)))
            assert torch.equal(zigzag_unshard(parts), whole), cp
            # with sequence parallelism inside the cp shard: tp ranks split its 16/cp tokens
            for rank in range(cp):
                drop.cp_shard = _cp_shard(cp, rank)
                local = zigzag_shard(x, cp, rank)
                n = local.shape[1] // 2
                for tp_rank in range(2):
                    drop.split = (1, tp_rank, 2)
                    got = drop(local[:, tp_rank * n : (tp_rank + 1) * n])
                    want = zigzag_shard(whole, cp, rank)[:, tp_rank * n : (tp_rank + 1) * n]
                    assert torch.equal(got, want), (cp, rank, tp_rank)
                drop.split = None
        drop.cp_shard = None


def test_ring_attention_mask_rows_are_the_whole_attention_mask_rows() -> None:
    attn = Attention(GPTConfig(vocab_size=5, seq_len=16, num_layers=1, hidden=8, num_heads=4,
                               dropout=0.2))  # fmt: skip
    attn.site, attn.head_offset = 9, 2  # a tensor-parallel rank holding heads 2..3
    draw = Draw(seed=4, step=3, index=1)
    q = torch.zeros(2, 2, 8, 2)  # [b, heads/tp, 16/cp, head_dim], cp=2
    whole = keep_mask(draw, 9, 0.2, (2, 4, 16, 16), (0, 0, 0, 0), (2, 4, 16, 16),
                      torch.device("cpu"))  # fmt: skip
    for rank in range(2):
        got = attn._ring_keep(q, draw, _cp_shard(2, rank))
        want = whole[:, 2:4].index_select(2, zigzag_positions(16, 2, rank))
        assert torch.equal(got, want), rank
