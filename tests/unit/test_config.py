"""Configuration: TOML and flags build validated dataclasses; bad input names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.config import TrainConfig, load_config


def test_defaults_are_the_readme_job() -> None:
    cfg = load_config()
    assert (cfg.nproc, cfg.parallel.pp, cfg.parallel.schedule) == (2, 2, "1f1b")
    assert cfg.model.name == "gpt"


def test_toml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'nproc = 4\nmax_steps = 7\n[model]\nlayers = 6\n[parallel]\npp = 4\nschedule = "gpipe"\n'
    )
    cfg = load_config(path, max_steps=3, **{"parallel.microbatches": 8})
    assert (cfg.max_steps, cfg.model.layers, cfg.parallel.pp) == (3, 6, 4)
    assert cfg.parallel.microbatches == 8
    assert isinstance(cfg, TrainConfig)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"nproc": 3}, "nproc=3 workers but dp × tp × pp = 1 × 1 × 2 = 2"),
        ({"parallel.schedule": "dualpipe"}, "schedule='dualpipe' is unknown"),
        ({"parallel.schedule": "interleaved"}, "chunks=1: interleaved needs >= 2"),
        ({"batch_size": 30}, "batch_size=30 is not divisible by dp × microbatches = 4"),
        ({"model.hidden": 100, "model.heads": 3}, "hidden=100 is not a multiple of heads=3"),
        ({"model.layers": 1, "nproc": 4, "parallel.pp": 4}, "exceed the model.s 3 blocks"),
        ({"max_steps": 0}, "max_steps=0 must be a positive integer"),
        ({"checkpoint_every": 0}, "checkpoint_every=0 must be a positive integer, or unset"),
        ({"keep": -1}, "keep=-1 must be a positive integer, or 0 to keep every one"),
        ({"max_restarts": 2}, "max_restarts=2 without checkpoint_every"),
        ({"max_restarts": -1, "checkpoint_every": 5}, "max_restarts=-1 must be 0 or more"),
        ({"timeout_s": 0.0}, "timeout_s=0.0 must be positive"),
        ({"parallel.schedule": "pipedream", "parallel.dtype": "fp16"}, "loss scaling needs"),
        ({"parallel.schedule": "2bw", "parallel.tp": 2, "parallel.pp": 1}, "tp=2: weight copies"),
        (
            {"parallel.schedule": "chimera", "parallel.tp": 2, "parallel.pp": 1},
            "'chimera' .replicated stages. with tp=2: the sum of a part's replicas",
        ),
        ({"parallel.schedule": "zb-v"}, "chunks=1: zb-v places exactly 2 stages"),
    ],
)
def test_bad_values_name_the_field_and_fix(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(**overrides)


def test_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nlayer = 3\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['layer'\] in \[model\]"):
        load_config(path)


def test_parallel_plan_validation() -> None:
    from plait.config import ParallelPlan

    with pytest.raises(ValueError, match="zero=4 must be 0, 1, 2 or 3"):
        ParallelPlan(zero=4)
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        ParallelPlan(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"partition=\[1, 2, 3\] must give >= 1 block"):
        ParallelPlan(pp=2, partition=(1, 2, 3))
    assert ParallelPlan(dp=2, tp=2, pp=2).world_size == 8
    with pytest.raises(ValueError, match="tp=3 must divide heads=4"):
        load_config(**{"parallel.tp": 3, "parallel.pp": 1})
