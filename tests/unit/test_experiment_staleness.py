"""`plait experiment staleness` (seed 003 §4): the config refuses bad values by name, a
tiny run reports what the JSON contract promises, a synchronous pipeline learns the same at
every depth, and the CLI prints one JSON line. Tiny models and budgets: seconds, not the
experiment's minutes."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from plait.cli.main import main
from plait.experiment.staleness import StalenessConfig, StalenessResult, run_experiment
from plait.experiment.staleness_plot import plot

TINY: dict[str, Any] = {
    "schedules": ("1f1b", "pipedream"),
    "stages": (1, 2),
    "num_microbatches": 2,
    "micro_batch_size": 4,
    "seq_len": 16,
    "num_layers": 2,
    "hidden": 16,
    "num_heads": 2,
    "budget": 32,
    "eval_every": 8,
    "eval_batches": 2,
    "train_sequences": 48,
}
RUN_KEYS = {"schedule", "stages", "updates_to_target", "samples_to_target", "epochs_to_target",
            "final_val_loss", "best_val_loss", "curve"}  # fmt: skip
POINT_KEYS = {"microbatches", "samples", "updates", "epochs", "val_loss", "val_accuracy", "time"}


@pytest.fixture(scope="module")
def tiny() -> StalenessResult:
    return run_experiment(StalenessConfig(**TINY), quiet=True)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stages": (2, 1)}, "stages"),
        ({"stages": ()}, "stages"),
        ({"stages": (0, 1)}, "stages"),
        ({"schedules": ("1f1b", "nope")}, "schedules"),
        ({"schedules": ()}, "schedules"),
        ({"num_layers": 13}, "num_layers"),
        ({"budget": 30}, "budget"),
        ({"eval_every": 6}, "eval_every"),
        ({"budget": 0}, "budget"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"lr": -1.0}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"target": 0.0}, "target"),
        ({"hidden": 50}, "hidden"),
        ({"train_sequences": 0}, "train_sequences"),
        ({"seed": -1}, "seed"),
    ],
)
def test_config_refuses_bad_values_naming_the_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        StalenessConfig(**fields)


def test_config_defaults_reach_sixteen_stages() -> None:
    config = StalenessConfig()
    assert max(config.stages) == 16 and config.num_layers + 2 >= 16
    assert config.learning_rate > 0 and StalenessConfig(optimizer="sgd").learning_rate > 0


def test_tiny_run_gives_the_json_contract(tiny: StalenessResult) -> None:
    out = json.loads(json.dumps(tiny.to_dict()))
    assert {"config", "target", "runs", "seed_paper", "findings"} <= set(out)
    assert out["seed_paper"]["gpus"] == [1, 16]
    assert all(isinstance(line, str) for line in out["findings"]) and out["findings"]
    assert [(r["schedule"], r["stages"]) for r in out["runs"]] == [
        (k, p) for k in TINY["schedules"] for p in TINY["stages"]
    ]
    for run in out["runs"]:
        assert set(run) >= RUN_KEYS
        samples = [pt["samples"] for pt in run["curve"]]
        assert all(set(pt) == POINT_KEYS for pt in run["curve"])
        assert samples == sorted(set(samples)) and samples[-1] == TINY["budget"] * 4
        assert run["curve"][-1]["val_loss"] == run["final_val_loss"]
        assert run["best_val_loss"] == min(pt["val_loss"] for pt in run["curve"])


def test_epochs_to_target_is_the_first_point_at_or_under_it(tiny: StalenessResult) -> None:
    out = tiny.to_dict()
    assert out["target"] == pytest.approx(out["runs"][0]["best_val_loss"] * 1.05)
    for run in out["runs"]:
        hits = [pt for pt in run["curve"] if pt["val_loss"] <= out["target"]]
        first = hits[0] if hits else None
        for key in ("updates", "samples", "epochs"):
            assert run[f"{key}_to_target"] == (None if first is None else first[key])
    # the reference run reaches its own target by construction
    assert out["runs"][0]["epochs_to_target"] is not None


def test_synchronous_curves_do_not_depend_on_the_stage_count(tiny: StalenessResult) -> None:
    one, two = (r for r in tiny.runs if r.schedule == "1f1b")
    assert [pt.microbatches for pt in one.curve] == [pt.microbatches for pt in two.curve]
    for a, b in zip(one.curve, two.curve, strict=True):
        assert a.val_loss == pytest.approx(b.val_loss, abs=1e-5)


def test_updates_follow_the_kind(tiny: StalenessResult) -> None:
    m = TINY["num_microbatches"]
    for run in tiny.runs:
        per_update = 1 if run.schedule == "pipedream" else m
        assert all(pt.updates * per_update == pt.microbatches for pt in run.curve)


def test_cli_json_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["experiment", "staleness", "--pp", "1,2", "--schedules", "1f1b,pipedream",
            "--budget", "8", "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert [r["stages"] for r in out["runs"]] == [1, 2, 1, 2]
    assert len(captured.err.strip().splitlines()) == 4  # one progress line per run


@pytest.mark.parametrize(
    ("flag", "value"), [("--pp", "1,x"), ("--budget", "6"), ("--schedules", "1f1b,nope")]
)
def test_cli_bad_values_exit_2_with_one_line(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["experiment", "staleness", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


def test_plot_writes_a_png(tiny: StalenessResult, tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    path = plot(tiny, tmp_path / "staleness.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
