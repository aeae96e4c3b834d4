"""The flags generated from the config fields: names, types, help, defaults; and the
checks on values that come from TOML, JSON and the API."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from plait.cli.main import build_parser, main
from plait.cli.options import add_config_flags, config_flags
from plait.config import ModelConfig, ParallelPlan, TrainConfig, load_config

# the flags `plait train` had before they were generated, and where each one lands:
# scripts rely on every one of them
LEGACY = {
    "--max-steps": "max_steps", "--run-dir": "run_dir", "--nproc": "nproc",
    "--batch-size": "batch_size", "--lr": "lr", "--seed": "seed", "--dp": "parallel.dp",
    "--tp": "parallel.tp", "--pp": "parallel.pp", "--schedule": "parallel.schedule",
    "--microbatches": "parallel.microbatches", "--chunks": "parallel.chunks",
    "--zero": "parallel.zero", "--recompute": "parallel.recompute",
    "--sequence-parallel": "parallel.sequence_parallel", "--dtype": "parallel.dtype",
    "--grad-clip": "grad_clip", "--plan": "plan", "--allow-staleness": "allow_staleness",
    "--checkpoint-every": "checkpoint_every", "--keep": "keep", "--resume": "resume",
    "--max-restarts": "max_restarts", "--log-every": "log_every", "--timeout": "timeout_s",
    "--layers": "model.layers", "--hidden": "model.hidden", "--heads": "model.heads",
    "--seq-len": "model.seq_len", "--sample-chars": "sample_chars",
}  # fmt: skip


def _train_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    train = sub.choices["train"]
    return {flag: a for a in train._actions for flag in a.option_strings}


def test_every_legacy_flag_keeps_its_name_and_destination() -> None:
    actions = _train_actions()
    assert {flag: actions[flag].dest for flag in LEGACY} == LEGACY


def test_every_config_field_is_a_flag_with_help_and_its_default() -> None:
    actions = _train_actions()
    for path, flag in config_flags(TrainConfig).items():
        action = actions[flag]
        assert action.dest == path
        assert action.help and "default" in action.help, flag
        assert action.default is None  # unset flags leave the file and the field in charge


@dataclass(frozen=True, kw_only=True)
class _Added:
    count: int = field(default=3, metadata={"help": "a count"})
    rate: float = field(default=0.5, metadata={"help": "a rate"})
    label: str = field(default="x", metadata={"help": "a label", "choices": ("x", "y")})
    on: bool = field(default=False, metadata={"help": "a switch"})
    limit: int | None = field(default=None, metadata={"help": "a limit"})
    sizes: tuple[int, ...] | None = field(default=None, metadata={"help": "sizes"})
    wait_s: float = field(default=1.0, metadata={"help": "a wait", "flag": "--wait"})
    hidden_field: int = field(default=0, metadata={"flag": None})


def test_a_new_field_becomes_a_flag_of_its_type() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, _Added)
    args = vars(parser.parse_args(
        ["--count", "7", "--rate", "0.25", "--label", "y", "--on", "--limit", "2",
         "--sizes", "1,2,3", "--wait", "4"]
    ))  # fmt: skip
    assert args == {"count": 7, "rate": 0.25, "label": "y", "on": True, "limit": 2,
                    "sizes": (1, 2, 3), "wait_s": 4.0}  # fmt: skip
    assert vars(parser.parse_args([])) == dict.fromkeys(args)
    for bad in (["--count", "x"], ["--rate", "inf"], ["--label", "z"], ["--sizes", "1,a"]):
        with pytest.raises((SystemExit, argparse.ArgumentError)):
            parser.parse_args(bad)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr": "fast"}, "lr='fast' must be a number"),
        ({"model.layers": 2.5}, "layers=2.5 must be an integer"),
        ({"parallel.zero": True}, "zero=True must be an integer"),
        ({"lr": float("inf")}, "lr=inf"),
        ({"sample_chars": -1}, "sample_chars=-1"),
        ({"parallel.zero": 3}, "zero=3 with dp=1 does nothing"),
    ],
)
def test_wrong_types_and_useless_settings_are_clear_errors(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_config(**settings)


def test_a_toml_section_that_is_not_a_table_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("parallel = 3\n")
    with pytest.raises(ValueError, match=r"\[parallel\] must be a table"):
        load_config(path)


def test_the_api_checks_types_too() -> None:
    with pytest.raises(ValueError, match="zero=True"):
        ParallelPlan(dp=2, zero=True)  # type: ignore[arg-type]
    assert ParallelPlan(partition=[2, 4]).partition == (2, 4)  # type: ignore[arg-type]


def test_a_saved_config_json_loads_back_to_the_same_config(tmp_path: Path) -> None:
    cfg = TrainConfig(
        model=ModelConfig(layers=3, hidden=64),
        parallel=ParallelPlan(dp=2, pp=1, microbatches=2, zero=2, partition=(5,)),
        batch_size=8,
        lr=1e-3,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert load_config(path) == cfg


def test_plan_simulate_and_profile_describe_trains_default_model() -> None:
    parser = build_parser()
    model, dtype = ModelConfig(), ParallelPlan().dtype
    for argv in (["plan", "--cluster", "local-cpu", "--batch-size", "8"],
                 ["simulate"], ["profile"]):  # fmt: skip
        args = parser.parse_args(argv)
        got = (args.layers, args.hidden, args.heads, args.seq_len, args.dtype)
        assert got == (model.layers, model.hidden, model.heads, model.seq_len, dtype), argv


def _dry(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["train", "--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    return dict(json.loads(out[out.index("{") :]))


def test_nproc_without_pp_sets_the_pipeline_degree(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _dry(["--nproc", "4", "--dp", "2", "--tp", "2", "--zero", "3"], capsys)
    assert cfg["layout"]["pp"] == 1 and cfg["nproc"] == 4  # type: ignore[index]


def test_an_error_names_the_value_that_was_defaulted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--dry-run", "--nproc", "3", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert "nproc=3" in err and "not given, so the default: tp=1 (--tp), pp=2 (--pp)" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("plait ")


def test_field_names_of_the_sections_are_kept() -> None:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {"model", "parallel", "nproc", "plan", "run_dir", "timeout_s"} <= names


def test_grad_clip_zero_turns_clipping_off_from_the_command_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config(grad_clip=0.0).grad_clip is None
    assert main(["train", "--dry-run", "--grad-clip", "0"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{") :])["grad_clip"] is None
    with pytest.raises(ValueError, match=r"grad_clip=-1\.0 must be positive, or 0"):
        load_config(grad_clip=-1.0)


def test_dry_run_plans_when_the_layout_is_left_to_the_planner(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    monkeypatch.chdir(tmp_path)
    small = ["--layers", "2", "--hidden", "32", "--seq-len", "16", "--batch-size", "8"]
    assert main(["train", "--dry-run", "--nproc", "2", *small]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    found = re.search(r"--plan auto chooses dp=(\d+), tp=(\d+), pp=(\d+)", first)
    assert found is not None, first
    dp, tp, pp = map(int, found.groups())
    assert dp * tp * pp == 2 and list(tmp_path.iterdir()) == []
