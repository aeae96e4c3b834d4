"""A user's data without workers: `tokens:` files memory-mapped as nanoGPT writes them,
`jsonl:`, `text:` and `hf-disk:` tokenized by a small tokenizer trained here (ids compared
with the tokenizer's own encoding), batches that are windows of the stream and a pure
function of (seed, step), the held-out tail, the cache, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from plait.config import load_config  # noqa: E402
from plait.data import sources  # noqa: E402
from plait.data.sources import TokenData, token_data  # noqa: E402
from plait.data.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer  # noqa: E402
from plait.dataspec import parse_data  # noqa: E402
from plait.train.task import task_from_config  # noqa: E402

DOCS = [f"the cat sat on mat number {i} and the dog ran to the park {i % 7}" for i in range(60)]


def make_tokenizer(path: Path) -> Path:
    """A word-level tokenizer trained on DOCS, saved as tokenizer.json (used by other tests)."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return path


def _encode(tokenizer_file: Path, docs: list[str]) -> list[int]:
    """The stream an independent reading gives: each document's ids, one after the other."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    return [i for doc in docs for i in tok.encode(doc, add_special_tokens=False).ids]


def _check_windows(data: TokenData, stream: np.ndarray, seq: int) -> None:
    """Every row is a window of the stream (targets shifted by one), from its split."""
    cut = int(len(stream) * 0.9)
    for split, (lo, hi) in (("train", (0, cut)), ("validation", (cut, len(stream)))):
        inputs, targets = data.batch(3, 8, seq, seed=5, split=split)
        assert inputs.shape == targets.shape == (8, seq) and inputs.dtype == torch.int64
        torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
        for row_in, row_tg in zip(inputs.tolist(), targets.tolist(), strict=True):
            window = row_in + row_tg[-1:]
            starts = [s for s in range(lo, hi - seq) if stream[s : s + seq + 1].tolist() == window]
            assert starts, f"{split} row is no window of its split"
    again = data.batch(3, 8, seq, seed=5)
    torch.testing.assert_close(again[0], data.batch(3, 8, seq, seed=5)[0])
    assert not torch.equal(data.batch(4, 8, seq, seed=5)[0], again[0])


@pytest.mark.parametrize(("dtype", "name"), [("uint16", "train.bin"), ("uint32", "ids.u32")])
def test_token_files_are_memory_mapped(tmp_path: Path, dtype: str, name: str) -> None:
    stream = np.random.default_rng(0).integers(0, 70_000 if dtype == "uint32" else 500, 3000)
    path = tmp_path / name
    stream.astype(dtype).tofile(path)  # as nanoGPT's prepare.py writes it
    spec = parse_data(f"tokens:{path}")
    assert spec.option == dtype
    data = token_data(spec, CharTokenizer(), tmp_path / "cache")
    assert isinstance(data.ids, np.memmap) and data.vocab_size == int(stream.max()) + 1
    _check_windows(data, stream, seq=6)
    assert not (tmp_path / "cache").exists()  # token files need no cache


def test_jsonl_is_tokenized_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok_file = make_tokenizer(tmp_path / "tokenizer.json")
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    spec = parse_data(f"jsonl:{path}:body")
    tokenizer = HFTokenizer(tok_file)
    data = token_data(spec, tokenizer, tmp_path / "cache")
    expected = np.array(_encode(tok_file, DOCS))
    np.testing.assert_array_equal(np.asarray(data.ids), expected)
    assert data.vocab_size == tokenizers.Tokenizer.from_file(str(tok_file)).get_vocab_size()
    _check_windows(data, expected, seq=5)
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
    with pytest.raises(ValueError, match="has no text field 'text'"):
        token_data(parse_data(f"jsonl:{path}"), tokenizer, tmp_path / "other")

    def no_tokenizing(*_: object) -> None:
        raise AssertionError("tokenized again although cached")

    monkeypatch.setattr(sources, "_tokenize", no_tokenizing)
    cached = token_data(spec, tokenizer, tmp_path / "cache")
    np.testing.assert_array_equal(np.asarray(cached.ids), expected)


def test_text_folder_and_datasets_folder(tmp_path: Path) -> None:
    tok_file = make_tokenizer(tmp_path / "tokenizer.json")
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    for i, doc in enumerate(DOCS[:30]):
        (folder / ("sub" if i % 2 else ".") / f"{i:02d}.txt").write_text(doc)
    (folder / ".hidden").write_text("never read")
    data = token_data(parse_data(f"text:{folder}"), HFTokenizer(tok_file), tmp_path / "c")
    order = sorted(folder.rglob("*.txt"))
    np.testing.assert_array_equal(
        np.asarray(data.ids), _encode(tok_file, [p.read_text() for p in order])
    )
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(saved)
    data = token_data(parse_data(f"hf-disk:{saved}"), HFTokenizer(tok_file), tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(data.ids), _encode(tok_file, DOCS))


def test_a_language_task_on_token_data_feeds_the_model(tmp_path: Path) -> None:
    tok_file = make_tokenizer(tmp_path / "tokenizer.json")
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    cfg = load_config(data=f"jsonl:{path}", tokenizer=str(tok_file), run_dir=str(tmp_path / "r"),
                      **{"model.layers": 2, "model.hidden": 32, "model.seq_len": 8,
                         "batch_size": 4, "parallel.pp": 1})  # fmt: skip
    task = task_from_config(cfg)
    vocab = load_tokenizer(str(tok_file)).vocab_size
    model = task.model()
    assert model.blocks()[0].tok.num_embeddings == vocab
    inputs, targets = task.batch(0)
    assert inputs.shape == targets.shape == (4, 8) and int(inputs.max()) < vocab
    assert task.validation is not None and len(list(task.validation())) == cfg.eval_batches
    assert (tmp_path / "r" / "tokens").is_dir()


def test_bad_data_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "ids.dat").write_bytes(b"\0" * 64)
    cases = [
        ("text:/nowhere/at/all", "does not exist"),
        (f"tokens:{tmp_path / 'ids.dat'}", "say it: data='tokens:PATH:uint16'"),
        (f"tokens:{tmp_path / 'ids.dat'}:int8", "must be one of"),
        (f"hf-disk:{tmp_path / 'ids.dat'}", "is not a folder"),
        ("jsonl", "needs a path"),
        ("parquet:x", "is unknown"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            load_config(data=data)
    with pytest.raises(ValueError, match="tokenizer='/nowhere' does not exist"):
        load_config(tokenizer="/nowhere")
    small = tmp_path / "small.bin"
    np.array([1, 2, 900], dtype=np.uint16).tofile(small)
    with pytest.raises(ValueError, match="token id 900, outside the vocabulary of 512"):
        token_data(parse_data(f"tokens:{small}"), CharTokenizer(), tmp_path, vocab_size=512)
    with pytest.raises(ValueError, match="too few for seq_len=8"):
        TokenData(np.arange(20), 20).batch(0, 2, 8, split="validation")
