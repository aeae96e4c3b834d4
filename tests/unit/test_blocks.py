"""Models become blocks, blocks become stages, batches become micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.blocks import as_blocks, equal_split, stage_modules
from plait.data import stdlib_corpus
from plait.models import GPT, GPTConfig, SkipMLP
from plait.runtime import local_stages, split_microbatches
from plait.schedule import build


def test_sequential_and_blocks_method() -> None:
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(as_blocks(seq)) == 3
    gpt = GPT(GPTConfig(num_layers=3, hidden=8, num_heads=2, seq_len=4, vocab_size=7))
    assert len(as_blocks(gpt)) == 5
    with pytest.raises(TypeError, match="give the model a `blocks\\(\\)` method"):
        as_blocks(nn.Linear(2, 2))


def test_stages_compose_to_the_whole_model() -> None:
    torch.manual_seed(0)
    model = SkipMLP(dim=4, hidden=6, classes=3, num_blocks=5)
    x = torch.randn(3, 4)
    stages = stage_modules(as_blocks(model), equal_split(5, 3))
    assert [len(s.blocks) for s in stages] == [2, 2, 1]
    out: object = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, model(x))


def test_equal_split_rejects_too_many_stages() -> None:
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 stages"):
        equal_split(3, 4)


def test_local_stages_follow_the_schedule_placement() -> None:
    model = GPT(GPTConfig(num_layers=6, hidden=8, num_heads=2, seq_len=4, vocab_size=7))
    schedule = build("interleaved", 2, 4, 2)
    assert sorted(local_stages(model, schedule, 1)) == [1, 3]


def test_split_microbatches() -> None:
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = split_microbatches((x, {"y": y}), 3)
    assert len(parts) == 3
    torch.testing.assert_close(parts[1][1]["y"], y[2:4])
    with pytest.raises(ValueError, match="batch size 6 is not divisible by num_microbatches=4"):
        split_microbatches(x, 4)


def test_stdlib_corpus_batches_are_deterministic() -> None:
    corpus = stdlib_corpus(max_chars=50_000)
    x, y = corpus.batch(3, 4, 16, seed=1)
    x2, _ = corpus.batch(3, 4, 16, seed=1)
    assert x.shape == (4, 16) and torch.equal(x, x2)
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    assert corpus.decode(corpus.encode("def f():\n")) == "def f():\n"
