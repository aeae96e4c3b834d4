"""What a run ran on, for its summary.json: plait, torch and Python versions, the git commit of
the working directory (when it is a git checkout), the host name and the device."""

from __future__ import annotations

import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["git_commit", "run_environment"]


def _plait_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def git_commit(folder: Path | None = None) -> str | None:
    """The commit checked out in `folder` (the working directory), with "-dirty" when it has
    uncommitted changes; None outside a git checkout or without git."""
    where = folder or Path.cwd()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                              text=True, timeout=10, check=False)  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=where, capture_output=True, text=True, timeout=10,
                               check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({platform.processor() or platform.machine()})"


def run_environment(device: torch.device) -> dict[str, Any]:
    """The versions, commit, host and device of this run (rank 0's device)."""
    return {
        "versions": {
            "plait": _plait_version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "git_commit": git_commit(),
        "host": socket.gethostname(),
        "device": _device_name(device),
    }
