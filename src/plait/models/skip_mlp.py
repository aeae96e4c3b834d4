"""An MLP whose skip connection jumps over a pipeline stage boundary (a test model).

Blocks pass a tuple (hidden, skip) along; the last block adds the skip back, so when the
model is cut into stages every boundary carries two tensors, one of which (the input
itself) does not depend on any parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SkipMLP"]


class _In(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.fc(x)), x  # (hidden [b, hidden], skip [b, dim])


class _Mid(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, hx: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, skip = hx
        return torch.tanh(self.fc(h)) + h, skip


class _Out(nn.Module):
    def __init__(self, hidden: int, dim: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, dim)
        self.cls = nn.Linear(dim, classes)

    def forward(self, hx: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, skip = hx
        return self.cls(F.gelu(self.fc(h) + skip))  # [b, classes]


class SkipMLP(nn.Module):
    """`num_blocks` blocks: input, `num_blocks - 2` residual middles, output with the skip."""

    def __init__(self, *, dim: int = 16, hidden: int = 32, classes: int = 5, num_blocks: int = 8):
        super().__init__()
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: SkipMLP needs at least 2 blocks")
        mids = [_Mid(hidden) for _ in range(num_blocks - 2)]
        self.layers = nn.ModuleList([_In(dim, hidden), *mids, _Out(hidden, dim, classes)])

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: object = x
        for layer in self.layers:
            out = layer(out)
        assert isinstance(out, torch.Tensor)
        return out

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)
