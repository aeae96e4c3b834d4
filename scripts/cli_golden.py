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
# `local-cpu` devices hold this host's memory over its cores (`plait.cluster.local_cpu`),
# which differs by kilobytes between machines of the same size: those figures are recorded
# as offsets from the host's device memory, so a case pins what plait adds, not the host
_HOST_MEMORY = ("capacity", "capacity_bytes", "headroom_bytes")


def _host_memory() -> float:
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from plait.cluster import local_cpu

    return float(local_cpu().device(0).memory_bytes)


def _relative(value: object, host: float) -> object:
    """`value` with every `_HOST_MEMORY` figure made an offset from `host`."""
    if isinstance(value, dict):
        return {
            k: v - host if k in _HOST_MEMORY and isinstance(v, float) else _relative(v, host)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_relative(v, host) for v in value]
    return value


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
    on_host = any("local-cpu" in (d.get("device"), d.get("cluster")) for d in _dicts(value))
    if not on_host:
        return value
    relative = _relative(value, _host_memory())
    assert isinstance(relative, dict)
    return relative


def _dicts(value: object) -> list[dict[str, object]]:
    """Every dict inside `value`, itself included."""
    if isinstance(value, dict):
        return [value, *(d for v in value.values() for d in _dicts(v))]
    if isinstance(value, list):
        return [d for v in value for d in _dicts(v)]
    return []


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
