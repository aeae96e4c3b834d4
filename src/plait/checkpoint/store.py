"""Checkpoints on disk: written in the background, published atomically, verified on load.

A run's checkpoints live in one folder, one subfolder per checkpoint, `step-00000400`:
the files of `torch.distributed.checkpoint` (each rank's shards and the `.metadata`),
`plait.json` (the step and what the run needs to resume: plan, config, loss scale) and
`manifest.json` (every other file's size and SHA-256). A save is started with DCP's
`async_save`, which copies the state to host memory and writes it from a thread on a
process group of its own, so training goes on meanwhile; it writes into `step-N.tmp`. When
the write has finished on every rank (DCP's future on rank 0 resolves after its global
metadata, which it writes once every rank's shards are written and synced), a thread on
rank 0 writes `plait.json` and the manifest and renames the folder to `step-N` at once,
not at the next step: a kill a step after a save finds it published. A checkpoint exists
whole or not at all, and a crash mid-save leaves the previous ones untouched. Loading
verifies the manifest first; a checkpoint that is partial, truncated or altered is skipped,
with a message, for the one before it. Tensors are read by DCP with `weights_only`;
`plait.json` and the manifest are JSON.

A save that cannot be written (a full disk, a folder turned read-only) raises `SaveFailed`
on the training thread at the next step boundary, on every rank that saw it: one line
naming the step, the folder, the operating system's error and the remedy. The run stops
there; the checkpoints published before are untouched (the failed one stays a `.tmp`
folder, which no load reads and the next save of that step replaces).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import async_save

__all__ = ["Checkpoint", "CheckpointStore", "SaveFailed", "find", "published", "verify"]

MANIFEST, INFO = "manifest.json", "plait.json"
_PREFIX, _PENDING = "step-", ".tmp"


@dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint: its folder, its step and what `plait.json` holds."""

    path: Path
    step: int
    info: dict[str, Any]


def _name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def published(root: Path) -> list[Path]:
    """The published checkpoints under `root`, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    found = [p for p in found if not p.name.endswith(_PENDING) and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used, or None when every file is whole."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"no readable {MANIFEST} ({err.__class__.__name__}): the save did not finish"
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["size"]:
            return f"{name} has {file.stat().st_size} bytes, not {expected['size']} (truncated?)"
        if _digest(file) != expected["sha256"]:
            return f"{name} does not match its checksum (altered on disk)"
    if INFO not in manifest.get("files", {}):
        return f"{INFO} is not in the manifest"
    return None


def _load(path: Path) -> Checkpoint:
    info = json.loads((path / INFO).read_text())
    return Checkpoint(path, int(info["step"]), info)


def find(target: str | Path, root: Path) -> Checkpoint | None:
    """The checkpoint to resume from: for "auto", the newest good one under `root` (None
    when there is none); else the one at `target`, which must be good. Skipped damaged
    checkpoints are reported on stderr."""
    if str(target) != "auto":
        path = Path(target)
        why = verify(path)
        if why is not None:
            raise ValueError(f"checkpoint {path} cannot be used: {why}; give another or 'auto'")
        return _load(path)
    for path in published(root):
        why = verify(path)
        if why is None:
            return _load(path)
        print(f"plait: skipping checkpoint {path.name}: {why}", file=sys.stderr, flush=True)
    return None


class SaveFailed(RuntimeError):
    """A checkpoint could not be written or published (its message: the cause, the step,
    the folder and the remedy, in one line)."""


# what a user can do about the operating system's error, by errno
_REMEDIES = {
    errno.ENOSPC: "free space on that disk or lower --keep",
    errno.EDQUOT: "free space within the disk quota or lower --keep",
    errno.EROFS: "the folder is read-only: make it writable or give another --run-dir",
    errno.EACCES: "no permission to write there: fix the permissions or give another --run-dir",
    errno.EPERM: "no permission to write there: fix the permissions or give another --run-dir",
}


def _saving_failed(err: BaseException, step: int, root: Path) -> SaveFailed:
    """`err` (DCP's CheckpointException, which gathers every rank's error, or an OSError of
    the publication) as one line: the first operating-system error inside it, or its own
    first line, then the step, the folder and the remedy."""
    found = _os_error(err)
    if found is not None:
        cause = f"OSError: [Errno {found.errno}] {found.strerror}"
        remedy = _REMEDIES.get(found.errno or 0, "check that folder")
    else:
        failures = getattr(err, "failures", None)  # DCP's header names ranks, not causes
        inner = next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else err
        first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        cause, remedy = f"{type(inner).__name__}: {first}".rstrip(": "), "check that folder"
        if any(word in first.lower() for word in ("connection", "broken pipe", "timed out")):
            remedy = "a worker was lost or stalled meanwhile: see its error"
    return SaveFailed(f"{cause} while saving step {step} to {root}: {remedy}")


def _os_error(err: BaseException, depth: int = 0) -> OSError | None:
    if isinstance(err, OSError) or depth > 8:
        return err if isinstance(err, OSError) else None
    failures = getattr(err, "failures", None)  # DCP: {rank: (exception, stack)}
    inner = [pair[0] for pair in failures.values()] if isinstance(failures, dict) else []
    for candidate in (*inner, err.__cause__, err.__context__):
        found = _os_error(candidate, depth + 1) if candidate is not None else None
        if found is not None:
            return found
    return None


class _Save:
    """One save in flight: DCP's future and, on rank 0, the thread that publishes the
    checkpoint as soon as that future resolves."""

    def __init__(
        self, future: Future[Any], publish: Callable[[], None] | None, step: int, root: Path
    ) -> None:
        self.future, self.step, self.root = future, step, root
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if publish is not None:
            self.thread = threading.Thread(
                target=self._publish, args=(publish,), name="plait-publish", daemon=True
            )
            self.thread.start()

    def _publish(self, publish: Callable[[], None]) -> None:
        try:
            self.future.result()
            publish()
        except BaseException as err:  # raised again on the training thread by result()
            self.error = err

    def done(self) -> bool:
        return self.future.done() and (self.thread is None or not self.thread.is_alive())

    def result(self) -> None:
        """Wait for the write (and the publication); raise what either raised, as
        `SaveFailed` (DCP raises a BaseException, which would pass `except Exception`)."""
        try:
            if self.thread is not None:
                self.thread.join()
                if self.error is not None:
                    raise self.error
            else:
                self.future.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:
            raise _saving_failed(err, self.step, self.root) from err


class CheckpointStore:
    """Saves of one run into `root` (call on every rank; construction is a collective):
    one save in flight at a time, the newest `keep` published ones kept (all if None)."""

    def __init__(self, root: Path, *, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: keep at least one checkpoint, or None for all")
        self.root, self.keep = Path(root), keep
        self.rank = dist.get_rank()
        # saves coordinate on a gloo group of their own, away from training's collectives
        self.group = dist.new_group(backend="gloo")
        self._pending: _Save | None = None

    def save(self, step: int, state: dict[str, Any], info: dict[str, Any]) -> None:
        """Start saving `state` (DCP's state dict) as the checkpoint of `step`; `info` (JSON)
        goes to `plait.json`. Waits for the previous save first, if it is still writing."""
        self.wait()
        pending = self.root / f"{_name(step)}{_PENDING}"
        if self.rank == 0:
            shutil.rmtree(pending, ignore_errors=True)  # a save that died before
            try:
                pending.mkdir(parents=True)
            except OSError as err:
                raise _saving_failed(err, step, self.root) from err
        dist.barrier(group=self.group)
        future = async_save(state, checkpoint_id=str(pending), process_group=self.group)
        full = {**info, "step": step}
        publish = (lambda: self._publish(step, full)) if self.rank == 0 else None
        self._pending = _Save(_future(future), publish, step, self.root)

    def poll(self) -> None:
        """Raise what a finished save raised (cheap; call every step)."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def settle(self) -> None:
        """At a step boundary: rank 0 waits until the save in flight is published (it
        usually is: it had a whole step to write), so a kill after this step's metrics
        row finds it; the other ranks only poll."""
        if self.rank == 0:
            self.wait()
        else:
            self.poll()

    def wait(self) -> None:
        """Wait for the save in flight to be written and published."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()

    def _publish(self, step: int, info: dict[str, Any]) -> None:
        pending = self.root / f"{_name(step)}{_PENDING}"
        (pending / INFO).write_text(json.dumps(info, indent=2))
        files = {
            p.name: {"size": p.stat().st_size, "sha256": _digest(p)}
            for p in sorted(pending.iterdir())
            if p.is_file() and p.name != MANIFEST
        }
        _write_synced(pending / MANIFEST, json.dumps({"step": step, "files": files}, indent=2))
        final = self.root / _name(step)
        if final.exists():  # a checkpoint of this step from an earlier attempt
            shutil.rmtree(final)
        os.rename(pending, final)
        _sync_folder(self.root)  # the rename itself durable before a newer save prunes this
        self._prune()

    def _prune(self) -> None:
        if self.keep is None:
            return
        for old in published(self.root)[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _future(result: Any) -> Future[Any]:
    """DCP returns a Future, or (newer) a response holding the upload's Future."""
    return getattr(result, "upload_completion", result)
