"""A character-level corpus made from the Python standard library's own source files."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CharCorpus", "stdlib_corpus", "stdlib_text"]

_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII


@dataclass(frozen=True)
class CharCorpus:
    """Encoded text and its alphabet; batches are random windows, seeded per step."""

    ids: torch.Tensor  # [num_chars] int64
    alphabet: str

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def batch(
        self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [batch, seq]: windows from the first 90% (train) or the rest."""
        cut = int(len(self.ids) * 0.9)
        lo, hi = (0, cut) if split == "train" else (cut, len(self.ids))
        if hi - lo <= seq_len + 1:
            raise ValueError(f"corpus split '{split}' is shorter than seq_len={seq_len}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(lo, hi - seq_len - 1, (batch_size,), generator=g)
        windows = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.alphabet)}
        unknown = index["?"]
        return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.alphabet[i] for i in ids.tolist())


def stdlib_text(max_chars: int = 2_000_000) -> str:
    """The standard library's .py files in sorted order, cut at `max_chars` characters.

    Every Python installation ships these files, so the corpus needs no download and is
    the same on every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise FileNotFoundError(f"no Python source files under {root}: is the stdlib installed?")
    return "".join(parts)[:max_chars]


def stdlib_corpus(max_chars: int = 2_000_000) -> CharCorpus:
    """`stdlib_text` as characters."""
    corpus = CharCorpus(torch.empty(0, dtype=torch.long), _ALPHABET)
    return CharCorpus(corpus.encode(stdlib_text(max_chars)), _ALPHABET)
