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


# the model flags of plan, simulate and profile that set no ModelConfig field, so are
# declared by hand: `plait train` takes the vocabulary from its data and sizes micro-batches
# from --batch-size and --microbatches; the load imbalance is an assumption of the cost model
PRICED_ONLY = {"--vocab", "--micro-batch-size", "--imbalance"}


def _model_flags() -> dict[str, argparse.Action]:
    """The flags `add_model_arguments` gives a command: every model flag it takes."""
    from plait.cli.models import add_model_arguments

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return {flag: action for flag, action in _flags(parser).items() if flag not in ("-h", "--help")}


@pytest.mark.parametrize("command", ["plan", "simulate", "profile"])
def test_the_model_flags_are_trains(command: str) -> None:
    """Generated from ModelConfig's fields, as `plait train`'s are: the same spelling, help,
    choices, metavar and type; only the flags of PRICED_ONLY are declared by hand."""
    from plait.cli.models import MODELS

    commands = _commands()
    train = {flag: a for flag, a in _flags(commands["train"]).items()
             if a.dest.startswith("model.")}  # fmt: skip
    flags = _flags(commands[command])
    model = _model_flags()
    assert model.keys() - train.keys() == PRICED_ONLY
    shape = {"--model", "--layers", "--hidden", "--heads", "--seq-len", "--ffn-hidden"}
    assert shape | {"--experts", "--top-k", "--shared-expert"} <= model.keys()
    for flag in model.keys() - PRICED_ONLY:
        mine, theirs = flags[flag], train[flag]
        assert mine.option_strings == theirs.option_strings, flag
        assert (type(mine), mine.type) == (type(theirs), theirs.type), flag
        if flag == "--model":  # a cost model prices plait's own GPTs only: train's words
            assert mine.choices == list(MODELS) and mine.metavar is None  # for those
            entries = _without_default(theirs.help).removeprefix("model: ").split("; ")
            ours = _without_default(mine.help).removeprefix("model: ").split("; ")
            assert [e.split(" ")[0] for e in ours] == list(MODELS) and set(ours) < set(entries)
            continue
        assert _without_default(mine.help) == _without_default(theirs.help), flag
        assert (mine.choices, mine.metavar) == (theirs.choices, theirs.metavar), flag
    for action in model.values():  # the command's own default, where it has one
        if action.default is not None:
            assert re.search(r" \(default: [^)]*\)$", action.help or ""), action.option_strings


@pytest.mark.parametrize("command", ["plan", "simulate", "profile"])
def test_the_model_flags_keep_their_destinations(command: str) -> None:
    """The commands read `args.model`, `args.top_k`, ...; the expert flags are None when
    not given, so that a dense GPT refuses them by name."""
    argv = {"plan": ["--cluster", "local-cpu", "--batch-size", "8"]}.get(command, [])
    args = build_parser().parse_args([command, *argv])
    model = ModelConfig()
    assert (args.model, args.layers, args.hidden, args.heads, args.seq_len) == (
        model.name, model.layers, model.hidden, model.heads, model.seq_len)  # fmt: skip
    assert (args.ffn_hidden, args.vocab, args.micro_batch_size) == (0, 96, 1)
    moe = ("experts", "top_k", "capacity_factor", "moe_every", "shared_expert", "imbalance")
    assert all(getattr(args, name) is None for name in moe)
    args = build_parser().parse_args(
        [command, *argv, "--model", "moe-gpt", "--top-k", "1", "--capacity-factor", "0",
         "--shared-expert", "--seq-len", "32"])  # fmt: skip
    assert (args.model, args.top_k, args.capacity_factor, args.shared_expert) == (
        "moe-gpt", 1, 0.0, True)  # fmt: skip
    assert args.seq_len == 32


def test_a_dense_gpt_refuses_an_expert_flag_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli.main import main

    for flag in ("--shared-expert", "--no-shared-expert"):
        assert main(["simulate", "--cluster", "local-cpu", flag]) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} applies to --model moe-gpt only: add it, or drop {flag}" in err


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
