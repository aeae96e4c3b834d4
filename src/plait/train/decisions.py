"""`--plan auto` decides once: the workers' choice is kept on disk under a key of all it
depends on, so `plait train --dry-run` shows the plan a run with the same flags trains
under, and that run (or a restart) reuses it rather than measuring and deciding again.

Two decisions from two sets of measurements can differ when two plans are close (the
links and blocks are timed afresh each time, and this host's speed drifts), so a
preview and a run that each decided would disagree. The key holds every setting the
planner reads (the model, data, layout, numerics and optimizer flags, the worker count)
and the host (its name, cores, devices, torch and plait versions); settings the planner
does not read (steps, seed, logging, checkpoints, evaluation) leave it alone. `--replan`
measures and decides afresh, replacing the kept decision. Files live in
`~/.cache/plait/plans/` (`$XDG_CACHE_HOME/plait/plans` when set, `$PLAIT_PLANS_DIR`
when that is), one
`<sha256 of the key>.json` each, holding the key, the plan and why it was chosen.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

__all__ = ["decision_key", "default_dir", "load", "save"]

_VERSION = 3  # bump when what a decision means changes (2: --cluster files as declared;
# 3: offload and WSP searched with the other options)
# the TrainConfig fields the planner reads (or that change what it measures)
_PLANNED = ("model", "init_from", "parallel", "nproc", "device", "cluster", "plan",
            "allow_staleness", "compile", "tf32", "optimizer_impl", "optimizer",
            "batch_size", "data", "tokenizer")  # fmt: skip


def default_dir() -> Path:
    """`$PLAIT_PLANS_DIR` (tests keep theirs apart), else the user's cache."""
    from plait.profile.cache import default_cache_dir

    if os.environ.get("PLAIT_PLANS_DIR"):
        return Path(os.environ["PLAIT_PLANS_DIR"])
    return default_cache_dir().parent / "plans"  # beside the profiles, in plait's cache


def decision_key(cfg: dict[str, Any], world: int, device: str) -> dict[str, Any]:
    """What a decision for `cfg` (a TrainConfig as dict) on `world` workers of `device`
    (its name, as `plait.device.device_name` gives it) depends on."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        plait_version = version("plait")
    except PackageNotFoundError:  # run from a source tree that is not installed
        plait_version = "unknown"
    return {
        "version": _VERSION,
        "config": {k: cfg.get(k) for k in _PLANNED},
        # the planner reads the file's devices: a file edited in place is another decision
        "cluster_file": _contents(cfg.get("cluster")),
        "world": world,
        "device": device,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "plait": plait_version,
    }


def _contents(name: Any) -> str | None:
    """The sha256 of the cluster file `name` (None for a preset or none)."""
    path = Path(name) if isinstance(name, str) else None
    if path is None or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file(key: dict[str, Any], folder: Path | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return (folder or default_dir()) / f"{digest}.json"


def load(key: dict[str, Any], folder: Path | None = None) -> dict[str, Any] | None:
    """The plan decided under `key`, with `decision.source` "kept" and the file; None
    when none was kept (or the file is unreadable: decide again)."""
    path = _file(key, folder)
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != json.loads(json.dumps(key, default=str)):
        return None
    plan = dict(kept["plan"])
    made = plan.get("decision", {})
    plan["decision"] = {**made, "source": "kept", "kept_from": made.get("source"),
                        "file": str(path)}  # fmt: skip
    return plan


def save(key: dict[str, Any], plan: dict[str, Any], folder: Path | None = None) -> dict[str, Any]:
    """Keep `plan` as the decision under `key`; `plan` with `decision.file` set. A folder
    that cannot be written only costs the next run a decision of its own."""
    path = _file(key, folder)
    decision = {**plan.get("decision", {}), "file": str(path)}
    plan = {**plan, "decision": decision}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "plan": plan, "saved_at": time.time()},
                                  indent=2, default=str))  # fmt: skip
        tmp.replace(path)  # a reader sees the old file or the new one, never half
    except OSError:
        plan["decision"] = {**decision, "file": None}
    return plan
