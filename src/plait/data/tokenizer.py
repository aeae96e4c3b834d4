"""Tokenizers that turn documents into token ids: a Hugging Face `tokenizer.json` (through the
`tokenizers` package, which ships with transformers) or plait's printable-ASCII characters.

Both answer `vocab_size`, `encode_batch(texts) -> list[list[int]]`, `decode(ids)` and
`identity` (what a token cache is keyed by: the tokenizer file's digest, or "chars").
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from plait.data.corpus import _ALPHABET

__all__ = ["CharTokenizer", "HFTokenizer", "Tokenizer", "find_tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def identity(self) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    """The stdlib corpus's alphabet: newline and printable ASCII; other characters are '?'."""

    vocab_size = len(_ALPHABET)
    identity = "chars"

    def __init__(self) -> None:
        self.index = {c: i for i, c in enumerate(_ALPHABET)}

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        unknown = self.index["?"]
        return [[self.index.get(c, unknown) for c in text] for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(_ALPHABET[i] for i in ids)


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a tokenizer.json."""

    def __init__(self, path: Path) -> None:
        tokenizers: Any = importlib.import_module("tokenizers")
        try:
            self.inner = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises its own exception type
            raise ValueError(f"tokenizer {path} cannot be read by tokenizers: {err}") from None
        self.identity = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return int(self.inner.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # no special tokens: documents are joined into one stream, nothing is added per text
        encoded = self.inner.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.inner.decode(list(ids)))


def find_tokenizer(path: str) -> Path:
    """The tokenizer.json that `path` names: the file itself, or the one in a folder."""
    given = Path(path)
    found = given / "tokenizer.json" if given.is_dir() else given
    if not found.is_file():
        raise ValueError(
            f"tokenizer={path!r}: no tokenizer.json there; give the file, or a folder "
            "holding tokenizer.json (a Hugging Face model folder)"
        )
    return found


def load_tokenizer(path: str | None, init_from: str | None = None) -> Tokenizer:
    """The tokenizer at `path`; without one, that of the `init_from` model folder when it
    has a tokenizer.json; else the characters."""
    if path is not None:
        return HFTokenizer(find_tokenizer(path))
    if init_from is not None and (Path(init_from) / "tokenizer.json").is_file():
        return HFTokenizer(Path(init_from) / "tokenizer.json")
    return CharTokenizer()
