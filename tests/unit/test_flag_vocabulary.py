"""One vocabulary across commands: a flag that sets a field of the plan or the model is
spelled (and, for the layout, described) the same in `plait train`, `plan`, `simulate` and
`profile`; one idea has one name (`--batch-size`: the samples of a step over all replicas;
`--pp`: the pipeline ranks); a former name still works, with one line naming the new one."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from plait.cli.main import build_parser
from plait.config import ModelConfig, ParallelPlan


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each visible flag -> its action (deprecated names are hidden from `--help`)."""
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }


def _by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS}


def _without_default(text: str | None) -> str:
    return re.sub(r" \(default: [^)]*\)$", "", text or "")


def test_the_layout_flags_of_simulate_are_trains() -> None:
    """Generated from the same fields: the same spelling and help, for every layout field
    both take (the defaults differ: simulate predicts the smallest layout unless told)."""
    commands = _commands()
    train, simulate = _by_dest(commands["train"]), _by_dest(commands["simulate"])
    shared = 0
    for f in dataclasses.fields(ParallelPlan):
        mine, theirs = simulate.get(f.name), train.get(f"parallel.{f.name}")
        if mine is None or theirs is None:
            continue
        shared += 1
        assert mine.option_strings == theirs.option_strings, f.name
        if f.name != "dtype":  # the simulator also prices tf32 and fp8
            assert _without_default(mine.help) == _without_default(theirs.help), f.name
            assert mine.choices == theirs.choices, f.name
    assert shared >= 20  # every layout field but what simulate cannot take from flags


@pytest.mark.parametrize("command", ["plan", "simulate", "profile"])
def test_the_model_flags_are_spelled_as_trains(command: str) -> None:
    commands = _commands()
    train = _by_dest(commands["train"])
    theirs = {f.name: train[f"model.{f.name}"].option_strings
              for f in dataclasses.fields(ModelConfig) if f"model.{f.name}" in train}  # fmt: skip
    flags = _flags(commands[command])
    found = [name for name, options in theirs.items() if options[0] in flags]
    assert {"name", "layers", "hidden", "heads", "seq_len", "ffn_hidden", "experts"} <= set(found)


def test_one_idea_has_one_name() -> None:
    from plait.bench import asynchronous, pipeline

    commands = _commands()
    benches = {}
    for name, module in (("bench pipeline", pipeline), ("bench async", asynchronous)):
        parser = argparse.ArgumentParser(prog=name)
        module.add_arguments(parser)
        benches[name] = parser
    # the samples of one step over every replica
    for parser in (commands["train"], commands["plan"], *benches.values()):
        assert "--batch-size" in _flags(parser)
        assert "--global-batch" not in _flags(parser)
    # the pipeline ranks
    for parser in (commands["train"], commands["simulate"], commands["schedule"],
                   *benches.values()):  # fmt: skip
        assert "--pp" in _flags(parser) and "--stages" not in _flags(parser)


@pytest.mark.parametrize(
    ("argv", "old", "new", "dest", "value"),
    [
        (["plan", "--cluster", "local-cpu", "--global-batch", "8"], "--global-batch",
         "--batch-size", "global_batch", 8),
        (["schedule", "1f1b", "--stages", "3", "--microbatches", "4"], "--stages", "--pp",
         "stages", 3),
        (["experiment", "staleness", "--stages", "1,2"], "--stages", "--pp", "stages", "1,2"),
    ],
)  # fmt: skip
def test_a_former_name_sets_the_same_value_and_names_the_new_one(
    argv: list[str], old: str, new: str, dest: str, value: object,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    now = [new if a == old else a for a in argv]
    assert getattr(build_parser().parse_args(now), dest) == value
    assert capsys.readouterr().err == ""
    assert getattr(build_parser().parse_args(argv), dest) == value
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{old} is deprecated: use {new}" in err[0], err


def test_a_bench_former_name_works_too(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.bench import pipeline

    parser = argparse.ArgumentParser(prog="plait bench pipeline")
    pipeline.add_arguments(parser)
    old = parser.parse_args(["--stages", "3", "--vocab-size", "64"])
    assert (old.stages, old.vocab_size) == (3, 64)
    err = capsys.readouterr().err
    assert "--stages is deprecated: use --pp" in err and "--vocab-size is deprecated" in err
    new = parser.parse_args(["--pp", "3", "--vocab", "64"])
    assert (new.stages, new.vocab_size) == (3, 64) and capsys.readouterr().err == ""


def test_a_missing_required_flag_is_named_by_its_new_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from plait.cli.main import main

    assert main(["plan", "--cluster", "local-cpu"]) == 2
    assert "plait plan: error: --batch-size is required" in capsys.readouterr().err
    assert main(["schedule", "1f1b", "--microbatches", "4"]) == 2
    assert "plait schedule: error: --pp is required" in capsys.readouterr().err
