"""`--device` at the command line: the worker count a host gives, and the errors said before
any worker starts (GPU hosts mocked: torch.accelerator reports the devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from plait.cli.main import build_parser
from plait.cli.train_config import resolve as _resolve


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *_, **__: torch.device("cuda") if count else None)  # fmt: skip


def _resolved(*flags: str) -> dict[str, Any]:
    return _resolve(build_parser().parse_args(["train", *flags]))


def test_a_missing_gpu_is_one_line_and_no_worker_starts() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--device", "cuda", "--max-steps", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("plait train: error: device='cuda' but no GPU is visible")
    assert "--device cpu" in lines[0] and "Traceback" not in out.stderr
    assert "workers" not in out.stdout  # nothing was launched


def test_a_cpu_host_keeps_the_layouts_worker_count() -> None:
    assert _resolved("--max-steps", "1")["nproc"] == 2  # the default 2-stage layout
    assert _resolved("--device", "cpu", "--nproc", "1")["nproc"] == 1


@pytest.mark.parametrize("count", [1, 2])
def test_a_gpu_host_starts_one_worker_per_gpu(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    _gpus(monkeypatch, count)
    cfg = _resolved("--max-steps", "1")
    assert cfg["nproc"] == count and cfg["parallel"]["pp"] == count
    assert cfg["device"] == "auto" and cfg["plan"] == "auto"
    # CPU workers asked for: the layout decides, as on a CPU host
    assert _resolved("--device", "cpu")["nproc"] == 2


def test_more_workers_than_gpus_is_refused_naming_both_and_the_fixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _gpus(monkeypatch, 2)
    for flags in (["--nproc", "3"], ["--dp", "4"], ["--pp", "4", "--device", "cuda"]):
        with pytest.raises(ValueError) as err:
            _resolved(*flags)
        text = str(err.value)
        assert "workers on this host but 2 GPUs visible" in text, text
        assert "--nproc 2" in text and "--device cpu" in text
    assert _resolved("--nproc", "3", "--device", "cpu")["nproc"] == 3
