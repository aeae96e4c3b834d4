"""Outputs of `plait plan` and `plait simulate` for the documented examples, kept as files.

`python scripts/cli_golden.py --write` records them under tests/golden/cli/; `--check`
(the default) runs the same commands and says which output changed. A refactoring of the
layout, the config or the CLI must leave them identical; `tests/unit/test_cli_golden.py`
checks the quick ones in the suite, this script all of them (the GPT-3 plan takes about
20 s of CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "cli"
_GPT3 = [
    "--layers",
    "96",
    "--hidden",
    "12288",
    "--heads",
    "96",
    "--seq-len",
    "2048",
    "--vocab",
    "51200",
    "--dtype",
    "bf16",
    "--cluster",
    "dgx-a100-80gb",
]

# name -> (arguments, whether the suite runs it); `{tmp}` is a scratch folder
CASES: dict[str, tuple[list[str], bool]] = {
    "plan_local_cpu": (
        [
            "plan",
            "--cluster",
            "local-cpu",
            "--batch-size",
            "32",
            "--json",
            "--out",
            "{tmp}/plan.json",
        ],
        True,
    ),
    "simulate_local_cpu_plan": (["simulate", "--plan", "{tmp}/plan.json", "--json"], True),
    "simulate_gpt3_1f1b": (
        [
            "simulate",
            *_GPT3,
            "--dp",
            "1",
            "--tp",
            "8",
            "--pp",
            "8",
            "--schedule",
            "1f1b",
            "--microbatches",
            "64",
            "--micro-batch-size",
            "1",
            "--recompute",
            "full",
            "--json",
        ],
        True,
    ),
    "simulate_small_zb": (
        [
            "simulate",
            "--layers",
            "8",
            "--hidden",
            "512",
            "--heads",
            "8",
            "--seq-len",
            "256",
            "--cluster",
            "local-cpu",
            "--dp",
            "1",
            "--pp",
            "2",
            "--schedule",
            "zb-h1",
            "--microbatches",
            "4",
            "--json",
        ],
        True,
    ),
    "plan_gpt3": (
        [
            "plan",
            *_GPT3,
            "--nodes",
            "8",
            "--batch-size",
            "1536",
            "--top",
            "5",
            "--json",
            "--out",
            "{tmp}/gpt3.json",
        ],
        False,
    ),
    "simulate_gpt3_plan": (["simulate", "--plan", "{tmp}/gpt3.json", "--json"], False),
}


_VARYING = ("plan_seconds",)  # how long the search took: differs run to run


def run_case(args: list[str], tmp: str) -> dict[str, object]:
    """The JSON that `plait ARGS` prints."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    argv = [a.replace("{tmp}", tmp) for a in args]
    out = subprocess.run(
        [sys.executable, "-m", "plait", *argv], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode:
        raise RuntimeError(f"plait {' '.join(argv)} failed: {out.stderr.strip()[-800:]}")
    value: dict[str, object] = json.loads(out.stdout)
    for key in _VARYING:
        value.pop(key, None)
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the outputs")
    parser.add_argument("--only-quick", action="store_true", help="only the suite's cases")
    args = parser.parse_args(argv)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    changed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (case, quick) in CASES.items():
            if args.only_quick and not quick:
                continue
            value = run_case(case, tmp)
            path = GOLDEN / f"{name}.json"
            if args.write:
                path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
                print(f"wrote {path.relative_to(ROOT)}")
            elif json.loads(path.read_text()) != value:
                changed.append(name)
                print(f"CHANGED {name}")
            else:
                print(f"same    {name}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
