"""Every command and the API snippet of README.md work as written.

Each `./run train` command is checked whole with `--dry-run` (settings validated and
resolved, nothing trained); the ones the README once got wrong also train for real, with
`--max-steps 2`. `plait plan`, `simulate`, `profile` and `schedule` run as written. The
API snippet runs under the launcher it names. What is skipped says why.
"""

from __future__ import annotations

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
SKIPPED = {
    "test": "runs the test suite itself",
    "bench": "a bench measures plait against its peers for minutes",
    "experiment": "an experiment trains many models for minutes",
    "checkpoint": "reads the checkpoint of a 60-step run that the dry runs do not write",
}


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


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command(command: str, workdir: Path) -> None:
    words = shlex.split(command)[1:]
    if words[0] == "plait":
        words = words[1:]
    if words[0] in SKIPPED:
        pytest.skip(SKIPPED[words[0]])
    plait = [sys.executable, "-m", "plait.cli.main"]
    if words[0] != "train":
        _run([*plait, *words], workdir)
        return
    _run([*plait, *words, "--dry-run"], workdir)
    if any(part in command for part in TRAINED):
        run_dir = f"runs/readme-{len(list(workdir.glob('runs/*')))}"
        _run([*plait, *words, "--max-steps", "2", "--run-dir", run_dir], workdir)
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
