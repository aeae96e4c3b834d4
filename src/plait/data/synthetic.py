"""Synthetic, learnable datasets of any shape whose batches are pure functions of (seed, step).

`SyntheticClassification`: Gaussian inputs of any shape, labelled by a fixed random linear
rule (argmax of a random projection of the average-pooled input), so a linear model can
reach zero error and any model's loss can fall. `SyntheticTokens`: sequences drawn from a
fixed random sparse bigram table (each token has a few likely successors), so a language
model's loss can fall from log(vocab) towards the table's conditional entropy.

Both hold `size` samples; sample `i` depends only on (seed, i), and `batch(step, ...)`
draws sample indices with a generator seeded by (seed, step), like `CharCorpus.batch`:
every rank and every rerun sees the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["SyntheticClassification", "SyntheticTokens"]

_MAX_FEATURES = 64  # inputs are average-pooled to at most this many features for labelling
_SUCCESSORS = 4  # likely next tokens per token in the bigram table


def _generator(seed: int, stream: int, index: int) -> torch.Generator:
    """Independent streams: 0 the fixed rule, 1 per-step batches, 2 per-sample data."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) * 4 + stream)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")


def _indices(seed: int, step: int, batch_size: int, size: int) -> torch.Tensor:
    _check_positive(batch_size=batch_size)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    return torch.randint(0, size, (batch_size,), generator=_generator(seed, 1, step))


class SyntheticClassification:
    """`size` Gaussian inputs of `input_shape`, labelled by a fixed random linear rule."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, size: int = 1024, seed: int = 0
    ) -> None:
        self.input_shape = tuple(int(d) for d in input_shape)
        if not self.input_shape or any(d < 1 for d in self.input_shape):
            raise ValueError(
                f"input_shape={tuple(input_shape)} must be a non-empty shape of positive "
                "sizes, e.g. (3, 32, 32)"
            )
        _check_positive(num_classes=num_classes, size=size)
        self.num_classes, self.size, self.seed = num_classes, size, seed
        features = min(math.prod(self.input_shape), _MAX_FEATURES)
        self._rule = torch.randn(features, num_classes, generator=_generator(seed, 0, 0))

    def __len__(self) -> int:
        return self.size

    def sample(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs float32 [n, *input_shape], labels int64 [n]) of the samples `indices`."""
        if indices.numel() and (indices.min() < 0 or indices.max() >= self.size):
            raise ValueError(f"sample indices must lie in [0, {self.size}) (size={self.size})")
        inputs = torch.stack(
            [
                torch.randn(self.input_shape, generator=_generator(self.seed, 2, i))
                for i in indices.tolist()
            ]
        )
        return inputs, self.labels(inputs)

    def labels(self, inputs: torch.Tensor) -> torch.Tensor:
        """The rule: argmax over classes of the average-pooled inputs times a random matrix."""
        flat = inputs.reshape(inputs.shape[0], 1, -1)  # [n, 1, prod(input_shape)]
        pooled = F.adaptive_avg_pool1d(flat, self._rule.shape[0]).squeeze(1)  # [n, features]
        return (pooled @ self._rule).argmax(dim=1)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [batch, *input_shape], labels [batch]), the same for the same (seed, step)."""
        return self.sample(_indices(self.seed, step, batch_size, self.size))


class SyntheticTokens:
    """`size` token sequences of `seq_len + 1` tokens that follow a fixed random bigram table.

    The sequences are generated at construction: `size × (seq_len + 1)` int64 values.
    """

    def __init__(self, vocab: int, seq_len: int, size: int = 1024, seed: int = 0) -> None:
        _check_positive(vocab=vocab, seq_len=seq_len, size=size)
        self.vocab, self.seq_len, self.size, self.seed = vocab, seq_len, size, seed
        g = _generator(seed, 0, 0)
        k = min(_SUCCESSORS, vocab)
        self.successors = torch.stack(
            [torch.randperm(vocab, generator=g)[:k] for _ in range(vocab)]
        )
        self.probs = torch.softmax(2.0 * torch.randn(vocab, k, generator=g), dim=1)  # [vocab, k]
        self._sequences = self._generate(_generator(seed, 2, 0))  # [size, seq_len + 1]

    def _generate(self, g: torch.Generator) -> torch.Tensor:
        tokens = [torch.randint(0, self.vocab, (self.size,), generator=g)]
        for _ in range(self.seq_len):
            prev = tokens[-1]
            choice = torch.multinomial(self.probs[prev], 1, generator=g)  # [size, 1]
            tokens.append(self.successors[prev].gather(1, choice).squeeze(1))
        return torch.stack(tokens, dim=1)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def __len__(self) -> int:
        return self.size

    def entropy(self) -> float:
        """Mean conditional entropy of the next token (nats): roughly the lowest loss a model
        can reach (exact when every token is equally frequent)."""
        return float(-(self.probs * self.probs.log()).sum(dim=1).mean())

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) int64 [batch, seq_len]: targets are the inputs shifted by one."""
        windows = self._sequences[_indices(self.seed, step, batch_size, self.size)]
        return windows[:, :-1], windows[:, 1:]
