"""How a `data` setting names its source (kind, path, and a field or token dtype), parsed
and checked without reading the data, so a wrong one fails before any worker starts.

The forms (`plait train --data ...`):

- `stdlib`, `synthetic`, `digits`, `cifar100:PATH`: the built-in sets (`plait.data`).
- `text:PATH`: a UTF-8 text file, or a folder whose files (all of them, recursively, in
  sorted order; hidden ones skipped) are the documents.
- `jsonl:PATH[:FIELD]`: one JSON object per line; FIELD (default `text`) holds the
  document. PATH may be a folder of `.jsonl` files.
- `tokens:PATH[:DTYPE]`: a flat file of token ids as nanoGPT's `prepare.py` writes them
  (`np.array(ids, dtype=np.uint16).tofile(PATH)`), memory-mapped; DTYPE `uint16` or
  `uint32`, else from the suffix (`.u32`/`.uint32`: uint32; `.bin`, `.u16`, `.uint16`:
  uint16).
- `hf-disk:PATH[:FIELD]`: a Hugging Face `datasets` folder written by `save_to_disk` (a
  DatasetDict's `train` split); FIELD (default `text`) holds strings, or lists of token
  ids which are used as they are. Needs the `datasets` package (`plait[datasets]`).

The text forms are tokenized once (`--tokenizer`, else by characters) and cached in the
run folder. A PATH that itself contains `:` is read whole when it exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DATA_FORMS", "LANGUAGE_KINDS", "TOKEN_DTYPES", "DataSpec", "parse_data"]

DATA_FORMS = {
    "stdlib": "characters of the Python standard library's source",
    "synthetic": "generated data fitting the model",
    "digits": "scikit-learn's 8×8 handwritten digits, needs plait[data]",
    "cifar100:PATH": "CIFAR-100's python release extracted under PATH",
    "text:PATH": "a text file or a folder of text files, tokenized and cached",
    "jsonl:PATH[:FIELD]": "JSON lines, the document in FIELD (default text)",
    "tokens:PATH[:uint16|uint32]": "a flat token-id file (nanoGPT's .bin), memory-mapped",
    "hf-disk:PATH[:FIELD]": "a datasets folder from save_to_disk, needs plait[datasets]",
}
TOKEN_DTYPES = ("uint16", "uint32")
_SUFFIX_DTYPES = {".bin": "uint16", ".u16": "uint16", ".uint16": "uint16",
                  ".u32": "uint32", ".uint32": "uint32"}  # fmt: skip
_PLAIN = ("stdlib", "synthetic", "digits")
_WITH_PATH = ("cifar100", "text", "jsonl", "tokens", "hf-disk")
_OPTION = ("jsonl", "tokens", "hf-disk")  # kinds whose PATH may end in :FIELD or :DTYPE
LANGUAGE_KINDS = ("stdlib", "synthetic", "text", "jsonl", "tokens", "hf-disk")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """A parsed `data` setting: `option` is the field (jsonl, hf-disk) or dtype (tokens)."""

    kind: str
    path: str = ""
    option: str = ""

    @property
    def is_language(self) -> bool:
        return self.kind in LANGUAGE_KINDS

    @property
    def is_text(self) -> bool:
        """Documents that a tokenizer turns into ids (or the stdlib's characters)."""
        return self.kind in ("stdlib", "text", "jsonl", "hf-disk")


def _unknown(data: str) -> ValueError:
    return ValueError(f"data={data!r} is unknown; choose one of {list(DATA_FORMS)}")


def parse_data(data: str) -> DataSpec:
    """The source `data` names, with its path checked to exist; ValueError naming the fix."""
    kind, sep, rest = data.partition(":")
    if kind in _PLAIN:
        if sep:
            raise _unknown(data)
        return DataSpec(kind=kind)
    if kind not in _WITH_PATH:
        raise _unknown(data)
    if not rest:
        raise ValueError(f"data={data!r} needs a path: data='{kind}:PATH'")
    path, option = rest, ""
    if kind in _OPTION and ":" in rest and not Path(rest).exists():
        path, _, option = rest.rpartition(":")
    if kind in ("cifar100", "hf-disk") and not Path(path).is_dir():
        raise ValueError(f"data={data!r}: {path} is not a folder")
    if not Path(path).exists():
        raise ValueError(f"data={data!r}: {path} does not exist")
    if kind == "tokens":
        option = _token_dtype(data, path, option)
    elif kind in ("jsonl", "hf-disk"):
        option = option or "text"
    return DataSpec(kind=kind, path=path, option=option)


def _token_dtype(data: str, path: str, option: str) -> str:
    if option and option not in TOKEN_DTYPES:
        raise ValueError(f"data={data!r}: token dtype {option!r} must be one of {TOKEN_DTYPES}")
    dtype = option or _SUFFIX_DTYPES.get(Path(path).suffix)
    if dtype is None:
        raise ValueError(
            f"data={data!r}: cannot tell the token dtype from the name {Path(path).name!r}; "
            "say it: data='tokens:PATH:uint16' or 'tokens:PATH:uint32'"
        )
    if not Path(path).is_file():
        raise ValueError(f"data={data!r}: {path} is not a file of token ids")
    return dtype
