"""`plait schedule` through the console entry point: grid, JSON, program, bad input."""

from __future__ import annotations

import json

import pytest

from plait.cli.main import main
from plait.schedule import build, format_grid, format_program


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_grid_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "1f1b", "--pp", "2", "--microbatches", "3")
    assert code == 0 and err == ""
    grid, summary = out.rstrip("\n").split("\n\n")
    assert grid == format_grid(build("1f1b", 2, 3))
    assert summary == (
        "1f1b: 2 ranks, 2 stages, 3 micro-batches; unit-cost makespan 12, bubble 25.0%, "
        "peak in-flight micro-batches per rank [2, 1]"
    )


def test_program_shows_the_messages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "gpipe", "--pp", "2", "--microbatches", "2", "--program")
    assert code == 0
    assert out.split("\n\n")[0] == format_program(build("gpipe", 2, 2))
    assert "0SEND_F0" in out and "1RECV_F0" in out


@pytest.mark.parametrize(
    ("argv", "chunks"),
    [
        (["interleaved", "--pp", "2", "--microbatches", "4"], 2),  # chunks default to 2
        (["interleaved", "--pp", "3", "--microbatches", "6", "--chunks", "3"], 3),
        (["zb-h1", "--pp", "3", "--microbatches", "5"], 1),
    ],
)
def test_json_is_the_built_schedule(
    capsys: pytest.CaptureFixture[str], argv: list[str], chunks: int
) -> None:
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    expected = build(argv[0], int(argv[2]), int(argv[4]), chunks)
    assert json.loads(out) == expected.to_dict()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["1f1b", "--pp", "0", "--microbatches", "4"], "--pp 0: use a positive count"),
        (["gpipe", "--pp", "2", "--microbatches", "-1"], "--microbatches -1"),
        (["interleaved", "--pp", "2", "--microbatches", "4", "--chunks", "1"], "--chunks 1"),
        (
            ["1f1b", "--pp", "2", "--microbatches", "4", "--chunks", "2"],
            "applies only to ['interleaved', 'zb-v']",
        ),
    ],
)
def test_bad_values_exit_2_with_the_fix(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("plait schedule: error: ") and message in err
    assert "Traceback" not in err


def test_unknown_kind_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["schedule", "dualpipe", "--pp", "2", "--microbatches", "4"])
    assert caught.value.code == 2
    assert "invalid choice: 'dualpipe'" in capsys.readouterr().err


def test_missing_required_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["schedule", "1f1b", "--pp", "2"])
    assert "--microbatches" in capsys.readouterr().err
