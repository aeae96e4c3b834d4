"""Every command and the API snippet of README.md and the guide (docs/*.md) work as written.

The commands are the lines of the ```bash blocks, README's first, then each page's (each
command once: one written twice would run twice). Each `./run train` command is checked
whole with `--dry-run` (settings validated and resolved, nothing trained); the ones the
README once got wrong also train for real, with `--max-steps 2`, and the runs that
`plait checkpoint` reads train for real on a small model. `plait plan`, `simulate`,
`profile` and `schedule` run as written; every bench and experiment runs in its shortest
form: the documented flags, then the ones below that shrink the model and the number of
steps (a later flag wins). The Hugging Face commands read a small model folder, tokenizer
and data files that the `workdir` fixture writes where the page names them. A `torchrun`
command (also inside the SLURM script) is checked as the workers it launches would see it:
its `plait train` part with `--dry-run` and `--nproc` nodes × processes per node.
`pip install` lines are checked, not run (they would install): the extras they name exist,
the constraints file too. The API snippet runs under the launcher it names.
"""

from __future__ import annotations

import importlib.util
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
import torch

pytestmark = pytest.mark.readme

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# the guide's pages (docs/experiments/ holds generated reports, not commands)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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
                      "--steps", "1", "--warmup", "0", "--rounds", "1",
                      "--schedules", "1f1b,zb-v"],
    "bench compress": ["--workers", "2", "--methods", "none,fp16", "--steps", "5", "--warmup",
                       "0", *_TINY, "--batch-size", "8"],
    "bench sim-accuracy": ["--worlds", "2", "--schedules", "1f1b", "--microbatches", "2",
                           "--steps", "1", "--rounds", "1", "--warmup", "0",
                           "--profile-repeats", "1", "--layers", "2", "--hidden", "32",
                           "--seq-len", "16", "--micro-batch-size", "2"],
    "bench faults": ["--trials", "1", "--steps", "4", "--every", "2"],
    "bench scale": ["--cases", "sim", "--repeats", "1"],
    "bench moe": ["--workers", "1,2", "--tokens", "16", "--hidden", "16", "--ffn", "24",
                  "--experts", "4", "--steps", "1", "--warmup", "0"],
    "bench arrival": ["--sizes", "1", "--calls", "2", "--warmup", "0", "--compute-ms", "0.5"],
    "bench repartition": ["--steps", "4", "--slow-from", "1", "--window", "1", "--layers", "1",
                          "--block-ms", "1"],
    "bench single": ["--steps", "1", "--warmup", "1", "--no-compile", *_TINY, "--heads", "2",
                     "--batch-size", "2"],
    "bench hetpipe": ["--workers", "2", "--slow", "1", "--steps", "2", "--turn", "1",
                      "--window", "1", *_TINY, "--heads", "2", "--batch-size", "8"],
    "bench cp": ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "64",
                 "--repeats", "1", "--steps", "1"],
    "experiment staleness": ["--pp", "1,2", "--microbatches", "2", "--budget", "4"],
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
# the checkpointed runs `plait checkpoint` reads, trained for real on a small model
CHECKPOINTED = "--run-dir runs/ck"
HF_TRAINED = "--run-dir runs/hf"  # trained as written, on the small model folder below
_SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
          "--batch-size", "8", "--sample-chars", "0", "--eval-batches", "0"]  # fmt: skip


def _lines() -> list[str]:
    """Every line of the pages' bash blocks, continuations joined, comments cut."""
    out = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                if line and not line.startswith("#"):
                    out.append(line)
    return out


LINES = _lines()
COMMANDS = [line for line in LINES if line.startswith("./run ")]
TORCHRUN = [line.removeprefix("srun ") for line in LINES
            if line.startswith(("torchrun ", "srun torchrun "))]  # fmt: skip
PIP = [line for line in LINES if re.match(r"(\.venv/bin/)?pip install ", line)]
# what each other kind of line is, and how it is checked
OTHER = {
    r"python3\.11 -m venv \.venv$": "run with this interpreter (test_a_virtual_env_line)",
    r"tensorboard --logdir \S+$": "the folder a documented --tensorboard writes",
    r"head=\$\(scontrol ": "the SLURM script's first node, substituted in its torchrun line",
    r"export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1$": "torchrun's environment; "
    "tests/dist/test_torchrun_nodes.py starts its agents with it",
}


def test_every_documented_line_is_checked() -> None:
    checked = set(COMMANDS) | set(PIP)
    checked |= {line for line in LINES if line.removeprefix("srun ") in TORCHRUN}
    others = [x for x in LINES if x not in checked]
    unknown = [x for x in others if not any(re.match(p, x) for p in OTHER)]
    assert not unknown, unknown
    assert len(COMMANDS) == len(set(COMMANDS)), "a command written twice runs twice"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", work / "examples")
    _data_files(work)
    return work


_WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "to",
    "mat",
    "park",
    "big",
    "small",
    "red",
    "old",
    "tree",
    "house",
]


def _data_files(work: Path) -> None:
    """The files the Hugging Face page names: text, JSON lines and a token file."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    docs = [" ".join(_WORDS[i] for i in torch.randint(0, len(_WORDS), (12,), generator=g))
            for _ in range(300)]  # fmt: skip
    (work / "data" / "texts").mkdir(parents=True)
    for i in range(0, len(docs), 50):
        (work / "data" / "texts" / f"part{i:03d}.txt").write_text("\n".join(docs[i : i + 50]))
    (work / "data" / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n"
                                                      for d in docs))  # fmt: skip
    ids = torch.randint(0, 100, (20_000,), generator=g).numpy().astype(np.uint16)
    ids.tofile(work / "data" / "train.bin")


def _hf_folder(work: Path) -> None:
    """models/tiny-llama: a random 2-layer Llama saved by transformers, with a word-level
    tokenizer of the texts' words (no download)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    folder = work / "models" / "tiny-llama"
    if folder.is_dir():
        return
    from plait.models.hf import tiny_llama_config

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=128, seq_len=128)).save_pretrained(
        folder
    )
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator([" ".join(_WORDS)], trainer)
    tok.save(str(folder / "tokenizer.json"))


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
def hf_trained(workdir: Path) -> Path:
    """The Hugging Face page's run that its export reads, trained as written."""
    _hf_folder(workdir)
    for command in (c for c in COMMANDS if HF_TRAINED in c):
        _main(_words(command), workdir)
    return workdir / "runs" / "hf"


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
    if any(w in ("--init-from", "--tokenizer") or w.startswith("models/") for w in words):
        _hf_folder(workdir)
    if words[0] == "checkpoint":
        request.getfixturevalue("hf_trained" if "runs/hf/" in command else "checkpointed")
    if words[0] != "train":
        name = " ".join(words[:2])
        capsys.readouterr()
        _main([*words, *SHORTEST.get(name, [])], workdir)
        if name in CHECKS:
            assert "--json" in words, command
            CHECKS[name](json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        if words[:2] == ["checkpoint", "export"] and "hf" in words:
            assert (workdir / words[words.index("--out") + 1] / "config.json").is_file()
        return
    _main([*words, "--dry-run"], workdir)
    if any(part in command for part in TRAINED):
        run_dir = f"runs/readme-{len(list(workdir.glob('runs/*')))}"
        _main([*words, "--max-steps", "2", "--run-dir", run_dir], workdir)
        assert (workdir / run_dir / "summary.json").is_file()


# the slurm script's variables, as SLURM would set them on a 2-node job
_SLURM = {"SLURM_NNODES": "2", "SLURM_JOB_ID": "1234", "head": "node1"}


@pytest.mark.parametrize("command", TORCHRUN)
def test_torchrun_command(command: str, workdir: Path) -> None:
    """The `plait train` part of a torchrun line, as its nodes × processes workers see it."""
    for name, value in _SLURM.items():
        command = command.replace(f"${name}", value)
    words = shlex.split(command)
    torchrun, plait = words[: words.index("-m")], words[words.index("-m") + 2 :]
    nodes = int(torchrun[torchrun.index("--nnodes") + 1])
    per_node = int(torchrun[torchrun.index("--nproc-per-node") + 1])
    assert plait[0] == "train" and "--nproc" not in plait, command
    _main([*plait, "--nproc", str(nodes * per_node), "--dry-run"], workdir)


@pytest.mark.parametrize("line", PIP)
def test_pip_line_names_what_exists(line: str) -> None:
    """Not run (it would install): its extras exist, its constraints file and torch's
    version are the project's."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    words = shlex.split(line)
    if "-c" in words:
        assert (ROOT / words[words.index("-c") + 1]).is_file()
    for word in words:
        extras = re.fullmatch(r"\.\[([\w,-]+)\]", word)
        if extras:
            assert set(extras.group(1).split(",")) <= project["optional-dependencies"].keys()
        pinned = re.fullmatch(r"torch==(\d+)\.(\d+)\.\d+", word)
        if pinned:  # within the range pyproject.toml supports: torch>=2.11,<2.14
            assert (2, 11) <= (int(pinned.group(1)), int(pinned.group(2))) < (2, 14), word


def test_a_virtual_env_line(tmp_path: Path) -> None:
    """`python3.11 -m venv .venv`, with this interpreter, creates the environment."""
    assert any(line.startswith("python3.11 -m venv ") for line in LINES)
    _run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], tmp_path)
    assert (tmp_path / ".venv" / "bin" / "python").exists()


def test_tensorboard_reads_the_folder_a_documented_run_writes() -> None:
    for line in (x for x in LINES if x.startswith("tensorboard ")):
        folder = shlex.split(line)[2]
        assert any(f"--tensorboard {folder}" in c for c in COMMANDS), line
        assert importlib.util.find_spec("tensorboard") is not None


def test_the_api_snippet_runs_under_the_launcher_it_names(workdir: Path) -> None:
    page = (ROOT / "docs" / "own-model.md").read_text()
    snippet = re.search(r"## The Python API\n\n```python\n(.*?)```", page, flags=re.S)
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
