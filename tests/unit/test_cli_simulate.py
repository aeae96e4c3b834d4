"""`plait simulate` and `plait profile`: JSON keys, GPT-3 175B on 64 A100s, plans that do not
fit, and bad input (exit 2 with a message naming the flag)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.main import main

GPT3 = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq-len", "2048",
        "--vocab", "51200"]  # fmt: skip
A100_T8_P8 = ["--cluster", "dgx-a100-80gb", "--dp", "1", "--tp", "8", "--pp", "8",
              "--microbatches", "64", "--micro-batch-size", "1", "--dtype", "bf16"]  # fmt: skip
SMALL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--vocab", "96"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def simulate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, err = run(capsys, "simulate", *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert isinstance(data, dict)
    return data


def test_json_has_the_promised_keys(capsys: pytest.CaptureFixture[str]) -> None:
    data = simulate_json(capsys, *SMALL, "--cluster", "local-cpu", "--pp", "2",
                         "--microbatches", "4", "--dtype", "fp32")  # fmt: skip
    for key in ("step_time_s", "bubble_fraction", "tokens_per_s", "mfu", "peak_memory_bytes",
                "fits", "overflows", "memory", "partition", "plan"):  # fmt: skip
        assert key in data
    assert data["fits"] is True and data["overflows"] == []
    assert isinstance(data["peak_memory_bytes"], list) and len(data["peak_memory_bytes"]) == 2
    assert data["step_time_s"] > 0 and 0 <= data["bubble_fraction"] < 1  # type: ignore[operator]
    assert sum(data["partition"]["sizes"]) == 6  # type: ignore[index]


def test_gpt3_175b_fits_with_full_recompute_on_64_a100s(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = simulate_json(capsys, *GPT3, *A100_T8_P8, "--recompute", "full")
    assert data["fits"] is True
    assert data["cluster"]["num_nodes"] == 8  # type: ignore[index]
    assert len(data["peak_memory_bytes"]) == 8  # type: ignore[arg-type]
    assert max(data["peak_memory_bytes"]) < 80 * 2**30  # type: ignore[arg-type]
    # Narayanan et al. 2021 report 138 TFLOP/s per A100 (44% of peak) for this layout
    assert 0.3 < data["mfu"] < 0.6  # type: ignore[operator]


def test_a_plan_too_big_reports_the_rank_and_excess(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", *GPT3, *A100_T8_P8, "--schedule", "gpipe", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["fits"] is False
    overflows = data["overflows"]
    assert len(overflows) == 64  # every rank holds 64 micro-batches of activations
    first = overflows[0]
    assert {"rank", "pp_rank", "needed_bytes", "capacity_bytes", "excess_bytes"} <= set(first)
    assert first["excess_bytes"] == pytest.approx(first["needed_bytes"] - first["capacity_bytes"])
    assert first["excess_bytes"] > 100 * 2**30
    assert "does not fit" in err and "ranks 0-7 (pipeline rank 0)" in err and "GiB over" in err


def test_readable_summary_and_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    code, out, _ = run(capsys, "simulate", *SMALL, "--cluster", "local-cpu", "--pp", "2",
                       "--schedule", "zb-h1", "--microbatches", "3", "--dtype", "fp32",
                       "--trace", str(trace))  # fmt: skip
    assert code == 0
    assert "zb-h1" in out and "bubble" in out and "fits" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    simulate_json(capsys, *SMALL, "--cluster", "local-cpu", "--pp", "2", "--microbatches", "4",
                  "--dtype", "fp32", "--plot", str(png))  # fmt: skip
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "--tp 3 does not divide --heads 4"),
        (["--pp", "0"], "--pp 0 must be >= 1"),
        (["--pp", "8"], "makes 8 stages but the model has 6 blocks"),
        (["--chunks", "2"], "--chunks 2: chunks=2 applies only to ['interleaved', 'zb-v']"),
        (["--dtype", "fp7"], "dtype 'fp7' is unknown"),
        (["--heads", "5"], "--hidden 64 is not divisible by --heads 5"),
        (["--cluster", "nowhere"], "cluster 'nowhere' is neither a preset"),
        (["--dtype", "fp8", "--cluster", "dgx-a100-80gb"], "has no peak_flops for 'fp8'"),
    ],
)
def test_bad_input_exits_2_naming_the_value(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, "simulate", *SMALL, "--cluster", "local-cpu", *argv)
    assert code == 2
    assert message in err


@pytest.mark.parametrize(
    ("flag", "value"), [("--schedule", "2f2b"), ("--zero", "4")]
)  # the choices of the plan's fields, as `plait train` takes them
def test_a_value_outside_the_choices_is_an_argparse_error(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--cluster", "local-cpu", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "invalid choice" in err and value in err


def test_profile_analytic_for_a_model_too_large_to_build(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "profile", *GPT3, "--analytic", "--tp", "8", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["source"] == "analytic" and len(data["blocks"]) == 98
    layer = data["blocks"][1]
    assert layer["saved_bytes_recompute"] < layer["saved_bytes_selective"] < layer["saved_bytes"]
    assert data["model"]["num_params"] > 170e9


def test_profile_measures_a_small_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["profile", *SMALL, "--repeats", "2", "--warmup", "1", "--cache-dir", str(tmp_path)]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["source"] == "measured" and data["cached"] is False
    assert [b["name"] for b in data["blocks"]][:2] == ["embedding", "layer0"]
    assert all(b["forward_s"] > 0 for b in data["blocks"])
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "from the cache" in out


def test_profile_bad_dtype_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "profile", *SMALL, "--dtype", "fp8")
    assert code == 2 and "--dtype fp8 cannot be measured" in err


def test_chimera_costs_each_replica_as_its_part(capsys: pytest.CaptureFixture[str]) -> None:
    """Chimera on 2 ranks: the blocks are cut into 2 parts (not 4 stages), and each rank
    holds a replica of both, i.e. the parameters 1F1B spreads over its 2 ranks."""
    common = [*SMALL, "--cluster", "local-cpu", "--pp", "2", "--microbatches", "4"]
    chimera = simulate_json(capsys, *common, "--schedule", "chimera")
    one_f_one_b = simulate_json(capsys, *common, "--schedule", "1f1b")
    assert chimera["partition"] == one_f_one_b["partition"]
    total = sum(rank["params"] for rank in one_f_one_b["memory"])  # type: ignore[union-attr,index]
    assert [rank["params"] for rank in chimera["memory"]] == [total, total]  # type: ignore[union-attr,index]


def test_a_given_partition_is_the_cut_simulated(capsys: pytest.CaptureFixture[str]) -> None:
    """A plan's own cut (`--partition`, or a plan file's `partition`) is what is simulated:
    the block counts per stage, and each stage's compute is its blocks' (the same blocks
    simulated one cut further on take longer on the stage that gains one)."""
    base = [*SMALL, "--cluster", "local-cpu", "--pp", "2", "--microbatches", "4",
            "--dtype", "fp32"]  # fmt: skip
    even = simulate_json(capsys, *base, "--partition", "3,3")
    lopsided = simulate_json(capsys, *base, "--partition", "5,1")
    assert even["partition"]["sizes"] == [3, 3]  # type: ignore[index]
    assert lopsided["partition"]["sizes"] == [5, 1]  # type: ignore[index]
    busy = [[r["compute_s"] for r in d["ranks"]] for d in (even, lopsided)]  # type: ignore[attr-defined]
    assert busy[1][0] > busy[0][0] and busy[1][1] < busy[0][1]
    code, _, err = run(capsys, "simulate", *base, "--partition", "3,2")
    assert code == 2 and "partition=[3, 2] cuts 5 blocks but the model has 6" in err
