"""Every command and the API snippet of README.md work as written.

Each `./run train` command is checked whole with `--dry-run` (settings validated and
resolved, nothing trained); the ones the README once got wrong also train for real, with
`--max-steps 2`, and the checkpointed run that `plait checkpoint` reads trains for real on
a small model. `plait plan`, `simulate`, `profile` and `schedule` run as written; every
bench and experiment runs in its shortest form: the README's flags, then the ones below
that shrink the model and the number of steps (a later flag wins). The API snippet runs
under the launcher it names.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.readme

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# trained for real (2 steps): examples that once failed as written
TRAINED = ("--nproc 4 --dp 2 --tp 2 --zero 3", "--plan plan.json")
SKIPPED = {"test": "runs the test suite itself"}
_TINY = ["--layers", "1", "--hidden", "32", "--seq-len", "16"]
# the shortest form of each bench and experiment: appended to the README's own flags
SHORTEST = {
    "bench pipeline": ["--steps", "1", "--warmup", "0", *_TINY, "--heads", "2",
                       "--batch-size", "8"],
    "bench dp": ["--workers", "2", "--steps", "1", "--warmup", "0", *_TINY, "--heads", "2",
                 "--batch-size", "8"],
    "bench async": ["--steps", "1", "--warmup", "0", "--rounds", "1", *_TINY, "--heads", "2",
                    "--batch-size", "8"],
    "bench planner": ["--workers", "2", *_TINY, "--heads", "2", "--batch-size", "8",
                      "--steps", "1", "--warmup", "0"],
    "bench compress": ["--workers", "2", "--methods", "none,fp16", "--steps", "5", "--warmup",
                       "0", *_TINY, "--batch-size", "8"],
    "bench sim-accuracy": ["--worlds", "2", "--schedules", "1f1b", "--microbatches", "2",
                           "--steps", "1", "--rounds", "1", "--warmup", "0",
                           "--profile-repeats", "1", "--layers", "2", "--hidden", "32",
                           "--seq-len", "16", "--micro-batch-size", "2"],
    "bench faults": ["--trials", "1", "--steps", "4", "--every", "2"],
    "bench moe": ["--workers", "1,2", "--tokens", "16", "--hidden", "16", "--ffn", "24",
                  "--experts", "4", "--steps", "1", "--warmup", "0"],
    "bench arrival": ["--sizes", "1", "--calls", "2", "--warmup", "0", "--compute-ms", "0.5"],
    "bench repartition": ["--steps", "4", "--slow-from", "1", "--window", "1", "--layers", "1",
                          "--block-ms", "1"],
    "bench single": ["--steps", "1", "--warmup", "1", "--no-compile", *_TINY, "--heads", "2",
                     "--batch-size", "2"],
    "bench hetpipe": ["--workers", "2", "--slow", "1", "--steps", "2", "--turn", "1",
                      "--window", "1", *_TINY, "--heads", "2", "--batch-size", "8"],
    "experiment staleness": ["--stages", "1,2", "--microbatches", "2", "--budget", "4"],
    "experiment convergence": ["--quick", "--sections", "image"],
    # the measured halves train for real in tests/dist/test_experiment_seeds.py
    "experiment dp-vs-gpipe": ["--predict-only"],
    "experiment data-movement": ["--predict-only", "--models", "mobilenet_v2"],
    "experiment all": ["--predict-only", "--movement-models", "mobilenet_v2"],
}  # fmt: skip


def _faults_recovered(out: dict[str, object]) -> None:
    """One SIGKILLed run recovered, ending bit-identical to an uninterrupted one."""
    assert {"trials", "recovered", "bit_identical", "median_recovery_s", "max_recovery_s",
            "lost_steps_median"} <= out.keys()  # fmt: skip
    assert (out["trials"], out["recovered"], out["bit_identical"]) == (1, 1, 1), out
    trial = out["per_trial"][0]  # type: ignore[index]
    assert trial["cause"] == "SIGKILL" and 0 <= trial["failed_rank"] < 2
    assert trial["resumed_from"] <= trial["steps_done_at_kill"]
    assert trial["lost_steps"] == trial["steps_done_at_kill"] - trial["resumed_from"]
    assert 0 < out["median_recovery_s"] <= out["max_recovery_s"]  # type: ignore[operator]


def _single_compared(out: dict[str, object]) -> None:
    """plait and the plain loops timed, the compiled ones skipped, the same first loss."""
    for key in ("plait_step_s", "plain_step_s", "plain_fused_step_s", "ratio_vs_best_plain"):
        assert isinstance(out[key], float) and out[key] > 0, (key, out)  # type: ignore[operator]
    assert out["plait_compiled_step_s"] is None and out["plain_compiled_step_s"] is None
    assert out["mfu"] is None and out["loss_match"] is True, out  # a CPU: no known peak


# what a bench's JSON (its last line) must say in its shortest form, beyond succeeding
CHECKS = {"bench faults": _faults_recovered, "bench single": _single_compared}
# the checkpointed run `plait checkpoint` reads, trained for real on a small model
CHECKPOINTED = "--run-dir runs/ck"
_SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
          "--batch-size", "8", "--sample-chars", "0", "--eval-batches", "0"]  # fmt: skip


def _commands() -> list[str]:
    """The `./run ...` lines of the README's bash blocks, continuations joined, comments cut."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("./run "):
                out.append(line)
    return out


COMMANDS = _commands()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", work / "examples")
    return work


def _run(argv: list[str], cwd: Path, timeout: float = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout


def test_the_readme_has_commands_to_check() -> None:
    assert sum(c.startswith("./run train") for c in COMMANDS) >= 8


def test_every_bench_and_experiment_has_a_shortest_form() -> None:
    named = {" ".join(_words(c)[:2]) for c in COMMANDS if _words(c)[0] in ("bench", "experiment")}
    assert named and named <= set(SHORTEST), sorted(named - set(SHORTEST))


def _words(command: str) -> list[str]:
    words = shlex.split(command)[1:]
    return words[1:] if words[0] == "plait" else words


@pytest.fixture(scope="module")
def checkpointed(workdir: Path) -> Path:
    """The README's checkpointed run (`--run-dir runs/ck`), trained as written but small."""
    for command in (c for c in COMMANDS if CHECKPOINTED in c):
        _main([*_words(command), *_SMALL], workdir)
    return workdir / "runs" / "ck"


def _main(argv: list[str], cwd: Path) -> None:
    """`plait ARGV` in this interpreter (as `./run plait` runs it, less the start-up of
    another Python; commands that launch workers launch them as they would there)."""
    from plait.cli.main import main

    with pytest.MonkeyPatch.context() as m:
        m.chdir(cwd)
        m.setenv("OMP_NUM_THREADS", "1")
        assert main(argv) == 0, shlex.join(argv)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command(
    command: str, workdir: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    words = _words(command)
    if words[0] in SKIPPED:
        pytest.skip(SKIPPED[words[0]])
    if words[0] == "checkpoint":
        request.getfixturevalue("checkpointed")
    if words[0] != "train":
        name = " ".join(words[:2])
        capsys.readouterr()
        _main([*words, *SHORTEST.get(name, [])], workdir)
        if name in CHECKS:
            assert "--json" in words, command
            CHECKS[name](json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        return
    _main([*words, "--dry-run"], workdir)
    if any(part in command for part in TRAINED):
        run_dir = f"runs/readme-{len(list(workdir.glob('runs/*')))}"
        _main([*words, "--max-steps", "2", "--run-dir", run_dir], workdir)
        assert (workdir / run_dir / "summary.json").is_file()


def test_the_api_snippet_runs_under_the_launcher_it_names(workdir: Path) -> None:
    snippet = re.search(r"## The Python API\n\n```python\n(.*?)```", README, flags=re.S)
    assert snippet is not None
    code = snippet.group(1)
    launcher = re.search(r"run with `(torchrun [^`]*)`", code)
    assert launcher is not None, "the snippet names its launcher"
    words = shlex.split(launcher.group(1))
    script = workdir / words[-1]
    script.write_text(code)
    torchrun = Path(sys.executable).with_name("torchrun")
    out = _run([str(torchrun), *words[1:]], workdir)
    losses = [float(line.split()[1]) for line in out.splitlines() if line[:1].isdigit()]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
