"""Your own model from the command line: a small causal language model built from torch's
`nn.TransformerEncoderLayer`, trained by plait on 2 pipeline workers with

    plait train --model examples/my_model.py:build --pp 2 --max-steps 50

What plait needs from it (see `plait.models.user`):

- `build(vocab_size=..., seq_len=...)`, named after the colon, returns the model. plait
  calls it in every worker after seeding torch, so every worker starts from the same
  weights; `vocab_size` is the data's (the tokenizer's), `seq_len` is `--seq-len`.
- The model lists its layers in order with `blocks()` (an `nn.Sequential` needs none):
  plait cuts that list into pipeline stages. Each block takes one tensor and returns one.
  The first block takes token ids [batch, seq]; the last returns logits [batch, seq, vocab].
- The loss is the model's `loss(output, targets)` (targets are the next ids, [batch, seq]),
  a mean over the micro-batch. Without one plait uses next-token cross-entropy; a factory
  may also return `(model, loss)`.

Any data plait reads as tokens works: the default stdlib characters, `--data text:DIR
--tokenizer tokenizer.json`, `--data tokens:train.bin`, ...
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    """Token ids [batch, seq] -> hidden states [batch, seq, hidden]."""

    def __init__(self, vocab_size: int, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden)
        self.positions = nn.Embedding(seq_len, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class CausalLayer(nn.Module):
    """One pre-norm transformer layer that attends only to earlier positions."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            hidden, heads, dim_feedforward=4 * hidden, dropout=0.0, batch_first=True,
            norm_first=True,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.layer(x, src_mask=mask, is_causal=True)


class Head(nn.Module):
    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))  # [batch, seq, vocab]


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [Embed(vocab_size, seq_len, hidden)]
            + [CausalLayer(hidden, heads=4) for _ in range(layers)]
            + [Head(hidden, vocab_size)]
        )

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            ids = layer(ids)
        return ids

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(vocab_size: int, seq_len: int) -> TinyLM:
    return TinyLM(vocab_size, seq_len)
