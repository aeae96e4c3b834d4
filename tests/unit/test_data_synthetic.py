"""Synthetic datasets: deterministic by (seed, step), shaped as asked, and learnable."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.data import SyntheticClassification, SyntheticTokens


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_classification_shapes_and_determinism() -> None:
    data = SyntheticClassification((3, 8, 8), num_classes=5, size=100, seed=1)
    x, y = data.batch(step=3, batch_size=7)
    assert x.shape == (7, 3, 8, 8) and x.dtype == torch.float32
    assert y.shape == (7,) and y.dtype == torch.int64 and y.min() >= 0 and y.max() < 5
    again = SyntheticClassification((3, 8, 8), num_classes=5, size=100, seed=1).batch(3, 7)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, data.batch(4, 7)[0])
    assert not torch.equal(x, SyntheticClassification((3, 8, 8), 5, 100, 2).batch(3, 7)[0])
    # a sample is the same whichever batch draws it
    first, _ = data.sample(torch.tensor([5, 9]))
    torch.testing.assert_close(data.sample(torch.tensor([9]))[0][0], first[1])
    assert data.batch(0, 4)[0].shape == (4, 3, 8, 8)
    assert SyntheticClassification((10,), 3).batch(0, 2)[0].shape == (2, 10)


def test_tokens_shapes_determinism_and_bigrams() -> None:
    data = SyntheticTokens(vocab=50, seq_len=12, size=64, seed=0)
    x, y = data.batch(step=2, batch_size=5)
    assert x.shape == y.shape == (5, 12) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    again = SyntheticTokens(vocab=50, seq_len=12, size=64, seed=0).batch(2, 5)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, data.batch(3, 5)[0])
    # every next token is one of its predecessor's few successors
    allowed = data.successors[x]  # [batch, seq, k]
    assert (allowed == y.unsqueeze(-1)).any(dim=-1).all()
    assert data.entropy() < math.log(4) < math.log(50)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="input_shape=\\(3, 0\\)"):
        SyntheticClassification((3, 0), 5)
    with pytest.raises(ValueError, match="vocab=0"):
        SyntheticTokens(0, 8)
    with pytest.raises(ValueError, match="batch_size=0"):
        SyntheticTokens(8, 8).batch(0, 0)


def _train(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float
) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_classification_is_learnable() -> None:
    torch.manual_seed(0)
    data = SyntheticClassification((2, 4, 4), num_classes=4, size=512, seed=0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(32, 4))
    losses = _train(model, [data.batch(s, 64) for s in range(30)], lr=0.5)
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5


def test_tokens_are_learnable() -> None:
    torch.manual_seed(0)
    data = SyntheticTokens(vocab=32, seq_len=16, size=256, seed=0)
    model = nn.Embedding(32, 32)  # a bigram model: logits of the next token per token
    losses = _train(model, [data.batch(s, 32) for s in range(30)], lr=20.0)
    assert losses[0] > 0.9 * math.log(32)
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0]
