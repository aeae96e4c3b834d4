"""The token data a language-model run trains on, chosen from `data`, `tokenizer` and
`init_from`: the stdlib's characters (the reference run, unchanged), synthetic tokens, or a
user's text, JSON lines, token file or `datasets` folder (`plait.data.sources`).

The vocabulary is the data's (the tokenizer's, or the characters'); under `init_from` it is
the pretrained model's, and the data's ids must fit in it. Text is tokenized once and cached
in the run folder's `tokens/` (`prepare_data` does it in the launching process, so the
workers only memory-map the file).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.config import TrainConfig
from plait.dataspec import parse_data

__all__ = ["LanguageData", "language_data", "prepare_data"]


@dataclass(frozen=True)
class LanguageData:
    """The data (`batch(step, batch_size, seq_len, seed=, split=)`, or synthetic tokens'
    `batch(step, batch_size)`), the model's vocabulary, and whether the ids are the stdlib
    corpus's characters (a text sample can be decoded)."""

    data: Any
    vocab_size: int
    characters: bool
    has_validation: bool


def _cache(cfg: TrainConfig) -> Path:
    """The run folder's tokens/ (a config without one, as `--dry-run` plans: a temporary
    folder)."""
    if cfg.run_dir is None:
        return Path(tempfile.gettempdir()) / "plait-tokens"
    return Path(cfg.run_dir) / "tokens"


def _pretrained_vocab(cfg: TrainConfig) -> int | None:
    if cfg.init_from is None:
        return None
    from plait.pretrained import read_pretrained

    return read_pretrained(cfg.init_from).vocab_size


def language_data(cfg: TrainConfig) -> LanguageData:
    """The token data of `cfg` (a language model's run)."""
    from plait.data import SyntheticTokens, stdlib_corpus
    from plait.data.sources import token_data
    from plait.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer, cfg.init_from)
    vocab = _pretrained_vocab(cfg)
    spec = parse_data(cfg.data)
    if spec.kind == "synthetic":
        data: Any = SyntheticTokens(vocab=64, seq_len=cfg.model.seq_len, size=4096, seed=cfg.seed)
        found = LanguageData(data, data.vocab_size, characters=False, has_validation=False)
    elif spec.kind == "stdlib" and tokenizer.identity == "chars":
        corpus = stdlib_corpus()
        found = LanguageData(corpus, corpus.vocab_size, characters=True, has_validation=True)
    else:
        stream = token_data(spec, tokenizer, _cache(cfg), vocab_size=vocab)
        chars = tokenizer.identity == "chars" and spec.kind != "tokens"
        found = LanguageData(stream, stream.vocab_size, characters=chars, has_validation=True)
    if vocab is not None and found.vocab_size > vocab:
        raise ValueError(
            f"data={cfg.data!r} has a vocabulary of {found.vocab_size}, more than the "
            f"{vocab} of init_from={cfg.init_from!r}: use its tokenizer (--tokenizer)"
        )
    # a sample is decoded by characters: only when the model's vocabulary is theirs
    characters = found.characters and (vocab is None or vocab == found.vocab_size)
    return LanguageData(found.data, vocab or found.vocab_size, characters, found.has_validation)


def prepare_data(cfg: TrainConfig) -> None:
    """Tokenize and cache the text data of `cfg` now (once, before the workers start);
    nothing for other data. Errors in the data (a missing field, ids outside the
    vocabulary) surface here as a ValueError."""
    if not cfg.model.is_language_model or cfg.model.name == "custom":
        return
    spec = parse_data(cfg.data)
    if spec.kind in ("synthetic",) or (spec.kind == "stdlib" and cfg.tokenizer is None
                                       and cfg.init_from is None):  # fmt: skip
        return
    language_data(cfg)
