"""What `plait` prints: `train --help` in sections with every enum's choices, whole bench
descriptions, tables not cut when piped, sizes in a unit that shows them, the default
`--keep` and what pruning keeps, torch's repeated advice dropped, `python -m plait`."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.checkpoint.store import CheckpointStore
from plait.cli.bench import _BENCHES, summary
from plait.cli.main import build_parser, main
from plait.cli.options import GROUPS, config_flags
from plait.config import TrainConfig
from plait.console import size

ROOT = Path(__file__).resolve().parents[2]
# the train flags whose values are names from a fixed set, and that set (written out here)
ENUMS = {
    "--optimizer": {"adamw", "sgd"},
    "--lr-schedule": {"constant", "cosine", "linear"},
    "--verbosity": {-1, 0, 1},
    "--device": {"auto", "cpu", "cuda"},
    "--dtype": {"fp32", "bf16", "fp16"},
    "--zero": {0, 1, 2, 3},
    "--recompute": {"none", "selective", "full"},
    "--optimizer-impl": {"auto", "fused", "foreach", "loop"},
    "--repartition": {"off", "auto"},
    "--schedule": {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "chimera",
                   "pipedream", "pipedream-vs", "2bw", "spectrain", "xpipe"},
}  # fmt: skip


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_every_train_flag_is_listed_in_a_section_in_order() -> None:
    parser = _train_parser()
    titles = [g.title for g in parser._action_groups]
    assert titles[2:] == list(GROUPS), titles  # after argparse's own two
    section = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    for path in config_flags(TrainConfig):
        assert section[path] in GROUPS, (path, section[path])
    assert section["parallel.schedule"] == "pipeline" and section["model.layers"] == "model"
    assert section["parallel.zero"] == "memory" and section["keep"] == "checkpoints"


def test_every_enum_flag_shows_its_choices_and_the_description_is_right() -> None:
    parser = _train_parser()
    actions = {f: a for a in parser._actions for f in a.option_strings}
    text = parser.format_help()
    for flag, values in ENUMS.items():
        assert set(actions[flag].choices or ()) == values, flag
        shown = "{" + ",".join(str(v) for v in actions[flag].choices or ()) + "}"
        assert f"{flag} {shown}" in text, flag
    description = " ".join((parser.description or "").split())
    assert "--plan auto" in description and "2-stage 1F1B" not in description


def test_bench_help_gives_each_bench_a_whole_first_sentence() -> None:
    import importlib

    for name, module in _BENCHES.items():
        doc = importlib.import_module(module).__doc__ or ""
        first = summary(doc)
        assert first.endswith((".", "?")) and first in " ".join(doc.split()), (name, first)
    assert summary("One line\nthat goes on. Then more.\n\nBody.") == "One line that goes on."


def test_sizes_use_the_unit_that_shows_them() -> None:
    for value, text in (
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.5 KiB"),
        (3 * 2**20 + 2**19, "3.5 MiB"),
        (int(11.8 * 2**30), "11.8 GiB"),
        (1000 * 2**20, "1000 MiB"),
    ):
        assert size(value) == text, (value, size(value))


def test_piped_tables_are_not_cut(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--cluster", "local-cpu"]) == 0  # captured: not a terminal
    out = capsys.readouterr().out
    assert "…" not in out, out
    header = next(line for line in out.splitlines() if "activations" in line)
    assert "transient" in header and "capacity" in header
    assert "0.00" not in out and "MiB" in out, out  # the small model's memory, readable


def test_keep_defaults_to_3_and_0_keeps_every_checkpoint() -> None:
    assert TrainConfig().keep == 3
    assert TrainConfig(keep=0).keep == 0
    with pytest.raises(ValueError, match="keep=-1"):
        TrainConfig(keep=-1)


def test_pruning_keeps_the_newest_and_the_save_being_written(tmp_path: Path) -> None:
    store = object.__new__(CheckpointStore)  # pruning needs no process group
    store.root, store.keep = tmp_path, 3
    for step in (5, 10, 15, 20, 25):
        (tmp_path / f"step-{step:08d}").mkdir()
    (tmp_path / "step-00000030.tmp").mkdir()  # a save in flight
    store._prune()
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["step-00000015", "step-00000020", "step-00000025", "step-00000030.tmp"]


def test_torchs_redistribution_advice_is_dropped_and_other_lines_kept() -> None:
    from plait.train.logs import setup

    setup(0, rank=0)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("While redistributing from %s to %s, 2 sequential all_reduce", "a", "b")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert seen == ["something else"]


def test_python_m_plait_prints_the_version() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "plait", "--version"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("plait "), done
