"""plait's checks on a GPU host: one line per check, PASS or FAIL with its figures.

Run from the repository root on a machine with CUDA and torch (no install needed: the
source tree is put on the path): `python3 scripts/gpu_check.py [--only NAME ...]`. It
finishes within 8 minutes on one GPU; each check has its own time limit. The exit code is
the number of checks that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT),
       "PYTHONUNBUFFERED": "1"}  # fmt: skip
PLAIT = [sys.executable, "-m", "plait"]


class Failed(Exception):
    pass


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise Failed(f"exit {out.returncode}: {' | '.join(tail)}")
    return out


def _summary(run_dir: Path) -> dict[str, object]:
    return dict(json.loads((run_dir / "summary.json").read_text()))


def _train(work: Path, name: str, *flags: str) -> str:
    run_dir = work / name
    _run([*PLAIT, "train", "--run-dir", str(run_dir), *flags], timeout=150)
    s = _summary(run_dir)
    plan = s["plan"]
    assert isinstance(plan, dict)
    layout = " ".join(f"{k}={plan[k]}" for k in ("dp", "tp", "pp", "schedule", "microbatches"))
    return (
        f"{layout} dtype={plan['dtype']}; loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}; "
        f"step {float(s['step_time_s']) * 1e3:.1f} ms; {float(s['tokens_per_s']):,.0f} tok/s; "
        f"peak {int(s['peak_memory_bytes']) / 2**20:.0f} MiB"  # type: ignore[call-overload]
    )


def check_pytest_gpu(work: Path) -> str:
    out = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                "-n", "0", "-o", "addopts=", "tests/gpu", "tests/unit/test_offload.py"],
               timeout=240)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def check_train_default(work: Path) -> str:
    return _train(work, "default", "--max-steps", "20")


def check_train_plan_auto(work: Path) -> str:
    return _train(work, "auto", "--plan", "auto", "--max-steps", "20")


def check_train_bf16(work: Path) -> str:
    return _train(work, "bf16", "--dtype", "bf16", "--max-steps", "20")


def check_profile(work: Path) -> str:
    out = _run([*PLAIT, "profile", "--json", "--no-cache", "--dtype", "bf16"], timeout=120)
    found = json.loads(out.stdout)
    d = found["device"]
    if d["type"] != "cuda":
        raise Failed(f"profiled on {d['type']}, not the GPU")
    rates = ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in d["flops_per_dtype"].items())
    fwd = sum(b["forward_s"] for b in found["blocks"]) * 1e3
    return (
        f"{d['count']} × {d['name']}: {rates}; memory {d['memory_bytes'] / 2**30:.0f} GiB; "
        f"model forward {fwd:.2f} ms (bf16 autocast)"
    )


# issue 26's two sizes (12 layers, hidden 1024; 24 layers, hidden 2048; seq 1024; bf16)
BENCH_SIZES = (("12", "1024", "16", "16"), ("24", "2048", "16", "8"))


def check_bench_single(work: Path) -> str:
    """plait's engine against the best plain loop (fused AdamW, torch.compile) on one GPU;
    fails above the issue's target ratio of 1.02."""
    figures, worst = [], 0.0
    for layers, hidden, heads, batch in BENCH_SIZES:
        out = _run([*PLAIT, "bench", "single", "--json", "--device", "cuda", "--dtype", "bf16",
                    "--layers", layers, "--hidden", hidden, "--heads", heads, "--seq-len",
                    "1024", "--batch-size", batch, "--steps", "3", "--warmup", "2",
                    "--repeats", "3"], timeout=170)  # fmt: skip
        d = json.loads(out.stdout.strip().splitlines()[-1])
        worst = max(worst, d["ratio_vs_best_plain"])
        mfu = f"{d['mfu']:.1%}" if d["mfu"] is not None else "n/a"
        figures.append(
            f"{layers}L h{hidden} b{batch}: plait {d['plait_step_s'] * 1e3:.1f} / compiled "
            f"{d['plait_compiled_step_s'] * 1e3:.1f} ms, plain {d['plain_step_s'] * 1e3:.1f} / "
            f"fused {d['plain_fused_step_s'] * 1e3:.1f} / compiled "
            f"{d['plain_compiled_step_s'] * 1e3:.1f} ms, ratio "
            f"{d['ratio_vs_best_plain']:.3f}, MFU {mfu}"
        )
    if worst > 1.02:
        raise Failed(f"ratio {worst:.3f} > 1.02: " + "; ".join(figures))
    return "; ".join(figures)


CHECKS: dict[str, Callable[[Path], str]] = {
    "pytest-gpu": check_pytest_gpu,
    "train-default": check_train_default,
    "train-plan-auto": check_train_plan_auto,
    "train-bf16": check_train_bf16,
    "profile": check_profile,
    "bench-single": check_bench_single,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks only")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.device_count()} GPU(s): "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")  # fmt: skip
    failed = 0
    with tempfile.TemporaryDirectory(prefix="plait-gpu-") as folder:
        for name in args.only or list(CHECKS):
            start = time.perf_counter()
            try:
                figures = CHECKS[name](Path(folder))
                print(f"PASS {name} ({time.perf_counter() - start:.0f} s): {figures}", flush=True)
            except (Failed, subprocess.TimeoutExpired, AssertionError, KeyError) as err:
                failed += 1
                print(f"FAIL {name} ({time.perf_counter() - start:.0f} s): {err}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
