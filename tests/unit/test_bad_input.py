"""Bad input as a new user types it: one line naming the value, exit code 2, no traceback,
and nothing started or written first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.main import main


def _fixtures(tmp: Path) -> None:
    (tmp / "a-file").write_text("x")
    (tmp / "folder").mkdir()
    (tmp / "fast.toml").write_text('lr = "fast"\n')
    (tmp / "table.toml").write_text("parallel = 3\n")
    (tmp / "model.json").write_text(json.dumps({"dp": 1, "tp": 1, "pp": 2, "model": "gpt"}))
    (tmp / "pp.json").write_text(json.dumps({"dp": 1, "tp": 1, "pp": "two"}))


CASES = [
    (["train", "--config", "missing.toml"], "config file missing.toml does not exist"),
    (["train", "--config", "folder"], "config file folder is not a file"),
    (["train", "--run-dir", "a-file"], "--run-dir a-file: a-file is a file"),
    (["train", "--run-dir", "a-file/run"], "a-file is a file"),
    (["train", "--config", "fast.toml"], "lr='fast' must be a number"),
    (["train", "--config", "table.toml"], "[parallel] must be a table"),
    (["train", "--plan", "model.json"], "its model must be an object"),
    (["train", "--plan", "pp.json"], "pp='two' must be an integer"),
    (["train", "--plan", "missing.json"], "plan file missing.json does not exist"),
    (["train", "--nproc", "0"], "--nproc 0 must be at least 1"),
    (["train", "--nproc", "10000"], "nproc=10000 workers"),
    (["train", "--zero", "3"], "zero=3 with dp=1 does nothing"),
    (["train", "--sample-chars", "-1"], "sample_chars=-1"),
    (["train", "--nproc", "4", "--dp", "2", "--tp", "2", "--pp", "2"], "nproc=4 workers"),
    (["plan", "--cluster", "local-cpu", "--batch-size", "8", "--out", "nowhere/p.json"],
     "folder nowhere does not exist"),
    (["plan", "--cluster", "local-cpu", "--batch-size", "8", "--devices", "0"],
     "--devices 0 must be at least 1"),
    (["profile", "--cache-dir", "a-file"], "--cache-dir a-file is a file"),
    (["simulate", "--cluster", "local-cpu", "--sequence-parallel"],
     "--sequence-parallel needs --tp > 1"),
    (["simulate", "--cluster", "local-cpu", "--dp", "64"], "64 ranks but cluster 'local-cpu'"),
    (["simulate", "--cluster", "local-cpu", "--dp", "1", "--zero", "2"], "--zero 2 with --dp 1"),
    (["schedule", "1f1b", "--pp", "100000", "--microbatches", "100000"],
     "--pp 100000 is more than this command prints"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_clear_line(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _fixtures(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing was started


def test_lr_inf_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--lr", "inf"])
    assert "'inf' is not a finite number" in capsys.readouterr().err


def test_fewer_microbatches_than_stages_warns(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="microbatches=1 is fewer than pp=2"):
        assert main(["train", "--dry-run", "--pp", "2", "--microbatches", "1"]) == 0
