"""`plait train` on a user's inputs, end to end on 2 gloo workers: a folder of text with a
tokenizer trained here (the loss falls), and the model of examples/my_model.py named as
MODULE:FACTORY (its first loss is that of the same model and batch in one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.cli.main import main
from plait.data import stdlib_corpus
from plait.models.user import load_factory
from tests.unit.test_data_sources import DOCS, make_tokenizer

pytestmark = pytest.mark.dist

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_model.py"


def _rows(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_text_folder_with_a_tokenizer_trains(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(0, len(DOCS), 6):
        (folder / f"part{i:03d}.txt").write_text("\n".join(DOCS[i : i + 6]))
    run_dir = tmp_path / "run"
    assert main(["train", "--data", f"text:{folder}", "--tokenizer", str(tokenizer),
                 "--max-steps", "12", "--pp", "2", "--layers", "2", "--hidden", "32",
                 "--seq-len", "16", "--batch-size", "16", "--run-dir", str(run_dir)]) == 0  # fmt: skip
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(12))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3  # type: ignore[misc]
    assert last < first - 0.5, (first, last)  # type: ignore[operator]
    assert len(list((run_dir / "tokens").glob("text-*.npy"))) == 1  # tokenized once, cached
    config = json.loads((run_dir / "config.json").read_text())
    assert config["tokenizer"] == str(tokenizer) and config["data"] == f"text:{folder}"


def test_a_model_of_ones_own_from_the_command_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "mine"
    model = f"{EXAMPLE}:build"
    assert main(["train", "--model", model, "--pp", "2", "--max-steps", "2", "--seq-len", "16",
                 "--batch-size", "8", "--run-dir", str(run_dir)]) == 0  # fmt: skip
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    # the same model and batch in one process: plait seeds with --seed (0) before building
    torch.manual_seed(0)
    reference = load_factory(model)(vocab_size=96, seq_len=16)
    inputs, targets = stdlib_corpus().batch(0, 8, 16, seed=0)
    with torch.no_grad():
        expected = float(reference.loss(reference(inputs), targets))
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert main(["train", "--model", f"{EXAMPLE}:nothing", "--pp", "2", "--dry-run"]) == 2
