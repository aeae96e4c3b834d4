"""A user's token data: a flat stream of token ids read from a text, JSON-lines, token or
`datasets` source (`plait.dataspec`), tokenized once into a memory-mapped cache.

Every source becomes one stream of ids (documents in order, one after the other). Its last
tenth is the validation split. The batch of step `s` is `batch_size` windows of `seq_len + 1`
ids, their starts drawn with a generator seeded by (seed, s), as `plait.data.CharCorpus`
draws them: a pure function of (seed, step), so every rank draws the same global batch and a
resumed run the very same batches.

Text is tokenized in the process that first needs it, and saved as a `.npy` file in the
cache folder (the run folder's `tokens/`), named by a digest of the source (paths, sizes and
modification times), the field and the tokenizer; later readers (the workers, a resumed
run) memory-map it. The file is written under another name and renamed, so concurrent
writers (torchrun's workers) never read half a file. A `tokens:` file is memory-mapped as
it is, nanoGPT style. Written here rather than through `torch.utils.data`: a window is a
slice of one array, no per-sample dataset or loader is needed, and the order is the step's.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.data.tokenizer import Tokenizer
from plait.dataspec import DataSpec

__all__ = ["TokenData", "token_data"]

_VALIDATION = 0.1  # the held-out tail's share of the stream
_BATCH_DOCS = 256  # documents tokenized per call (tokenizers runs a batch in parallel)


@dataclass(frozen=True)
class TokenData:
    """A stream of token ids (a numpy array, usually memory-mapped) and its vocabulary."""

    ids: np.ndarray  # [num_tokens] uint16 / uint32 / int64
    vocab_size: int

    def split(self, split: str, seq_len: int) -> tuple[int, int]:
        """The [lo, hi) range of `split` ("train": the first 90%, "validation": the rest)."""
        cut = int(len(self.ids) * (1 - _VALIDATION))
        lo, hi = (0, cut) if split == "train" else (cut, len(self.ids))
        if hi - lo <= seq_len + 1:
            raise ValueError(
                f"the data's {split} split holds {hi - lo} tokens, too few for seq_len={seq_len}: "
                "give more data or a shorter seq_len"
            )
        return lo, hi

    def batch(
        self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [batch, seq] int64: windows of the split, seeded by (seed, step)."""
        lo, hi = self.split(split, seq_len)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(lo, hi - seq_len - 1, (batch_size,), generator=g).tolist()
        windows = np.stack([np.asarray(self.ids[s : s + seq_len + 1]) for s in starts])
        tokens = torch.from_numpy(windows.astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]


def token_data(
    spec: DataSpec, tokenizer: Tokenizer, cache: Path, *, vocab_size: int | None = None
) -> TokenData:
    """The stream `spec` names. Text is tokenized by `tokenizer` (cached under `cache`);
    token files keep their ids. The vocabulary is `vocab_size` when given (a pretrained
    model's), else the tokenizer's (for a token file without a tokenizer, its largest id
    + 1). An id outside the vocabulary is an error naming both."""
    ids: np.ndarray = (
        np.memmap(spec.path, dtype=spec.option, mode="r")
        if spec.kind == "tokens"
        else _cached(spec, tokenizer, cache)
    )
    if len(ids) == 0:
        raise ValueError(f"data {spec.kind}:{spec.path} holds no tokens")
    largest = int(ids.max())
    if vocab_size is not None:
        vocab = vocab_size
    elif spec.kind == "tokens" and tokenizer.identity == "chars":
        vocab = largest + 1  # no tokenizer given: the ids say how many there are
    else:
        vocab = tokenizer.vocab_size
    if largest >= vocab:
        raise ValueError(
            f"data {spec.kind}:{spec.path} holds token id {largest}, outside the vocabulary of "
            f"{vocab}: use the tokenizer that made it (--tokenizer), or a model with a larger one"
        )
    return TokenData(ids, vocab)


def _files(spec: DataSpec) -> list[Path]:
    """The source's files, in the order their documents are read."""
    root = Path(spec.path)
    if root.is_file():
        return [root]
    pattern = "*.jsonl" if spec.kind == "jsonl" else "*"
    found = sorted(p for p in root.rglob(pattern) if p.is_file())
    files = [
        p for p in found if not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    if not files:
        raise ValueError(f"data {spec.kind}:{spec.path}: the folder holds no files to read")
    return files


def _digest(spec: DataSpec, tokenizer: Tokenizer) -> str:
    """What the cache file's content depends on: the source's files, the field, the tokenizer
    (the stdlib's text: the Python version)."""
    h = hashlib.sha256(json.dumps([spec.kind, spec.option, tokenizer.identity]).encode())
    if spec.kind == "stdlib":
        h.update(sys.version.encode())
    for path in _files(spec) if spec.kind != "stdlib" else []:
        stat = path.stat()
        h.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _cached(spec: DataSpec, tokenizer: Tokenizer, cache: Path) -> np.ndarray:
    path = cache / f"{spec.kind}-{_digest(spec, tokenizer)}.npy"
    if not path.is_file():
        ids = _tokenize(spec, tokenizer)
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with partial.open("wb") as out:
            np.save(out, ids)
        os.replace(partial, path)
    return np.load(path, mmap_mode="r")


def _tokenize(spec: DataSpec, tokenizer: Tokenizer) -> np.ndarray:
    """Every document's ids, one after the other, as the smallest unsigned dtype that fits."""
    parts: list[np.ndarray] = []
    batch: list[str] = []
    for doc in _documents(spec):
        if isinstance(doc, list):  # ids already (a datasets column of token lists)
            parts.append(np.asarray(doc, dtype=np.int64))
            continue
        batch.append(doc)
        if len(batch) == _BATCH_DOCS:
            parts += [np.asarray(x, dtype=np.int64) for x in tokenizer.encode_batch(batch)]
            batch = []
    if batch:
        parts += [np.asarray(x, dtype=np.int64) for x in tokenizer.encode_batch(batch)]
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(ids) and int(ids.min()) < 0:
        raise ValueError(f"data {spec.kind}:{spec.path} holds a negative token id")
    small = len(ids) == 0 or int(ids.max()) < 2**16
    return ids.astype(np.uint16 if small else np.uint32)


def _documents(spec: DataSpec) -> Iterator[str | list[int]]:
    if spec.kind == "stdlib":
        from plait.data.corpus import stdlib_text

        yield stdlib_text()
    elif spec.kind == "text":
        for path in _files(spec):
            yield path.read_text(encoding="utf-8", errors="replace")
    elif spec.kind == "jsonl":
        for path in _files(spec):
            yield from _jsonl(path, spec.option)
    else:
        yield from _hf_disk(spec)


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path}:{number} is not JSON ({err})") from None
            value = row.get(field) if isinstance(row, dict) else None
            if not isinstance(value, str):
                raise ValueError(
                    f"{path}:{number} has no text field {field!r}: name the field, "
                    f"data='jsonl:{path}:FIELD'"
                )
            yield value


def _hf_disk(spec: DataSpec) -> Iterator[str | list[int]]:
    datasets: Any = importlib.import_module("datasets")
    loaded = datasets.load_from_disk(spec.path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(
                f"data hf-disk:{spec.path} holds splits {list(loaded)} but no 'train': save "
                "the split to train on"
            )
        loaded = loaded["train"]
    if spec.option not in loaded.column_names:
        raise ValueError(
            f"data hf-disk:{spec.path} has no column {spec.option!r} (it has "
            f"{loaded.column_names}): name one, data='hf-disk:{spec.path}:COLUMN'"
        )
    for row in loaded.select_columns([spec.option]).iter(batch_size=_BATCH_DOCS):
        for value in row[spec.option]:
            yield value if isinstance(value, str) else [int(x) for x in value]
